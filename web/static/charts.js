// A small line-chart renderer on <canvas>: axes, nice ticks, several series, a legend.
// Axes are outlier-robust (robustRange): points far outside the others are drawn as triangles
// on the edge and counted in a note, so one bad round cannot flatten every other point. A
// missing value (null) is a gap in the line, never a zero.
(function () {
  "use strict";
  function niceStep(span, n) {
    const raw = span / Math.max(1, n), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const f = raw / mag;
    return (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  }
  function ticks(lo, hi, n) {
    if (!(hi > lo)) { hi = lo + 1; }
    const step = niceStep(hi - lo, n), out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }
  function fmtNum(v) {
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a === 0) return "0";
    if (a < 0.01) return v.toExponential(0);
    return +v.toFixed(a < 1 ? 3 : 2) + "";
  }
    // The y range to draw, robust to outliers: a value is off-scale when its gap to the next value
  // is more than 3 times the whole span of the values inside it (one wild round among normal
  // ones). At most 5% of the points on each side; a steep but steady curve keeps every point.
  function robustRange(ys) {
    const s = ys.slice().sort((a, b) => a - b);
    let lo = 0, hi = s.length - 1;
    const most = Math.max(1, Math.floor(s.length * 0.05));
    if (s.length >= 5) {
      for (let k = 0; k < most && hi - lo >= 3; k++) {
        if (s[hi] - s[hi - 1] > 3 * (s[hi - 1] - s[lo])) hi--; else break;
      }
      for (let k = 0; k < most && hi - lo >= 3; k++) {
        if (s[lo + 1] - s[lo] > 3 * (s[hi] - s[lo + 1])) lo++; else break;
      }
    }
    return [s[lo], s[hi]];
  }
  const FORMATS = {
    pct: (v) => (100 * v).toFixed(0) + "%",
    bytes: (v) => (window.fedswarm ? window.fedswarm.fmtBytes(v) : fmtNum(v)),
    num: fmtNum,
    sec: (v) => fmtNum(v) + " s",
  };
  const PALETTE = ["#2563eb", "#d97706", "#16a34a", "#9333ea", "#dc2626", "#0d9488", "#db2777", "#64748b"];

  class LineChart {
    constructor(canvas, opts) {
      this.canvas = canvas;
      this.opts = Object.assign({ format: "num", xFormat: "num", robust: true }, opts);
      this.series = (opts.series || []).map((s) => Object.assign({ pts: [] }, s));
      this._queued = false;
      if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
      this.draw();
    }
    static color(i) { return PALETTE[i % PALETTE.length]; }
    setSeries(series) { this.series = series.map((s) => Object.assign({ pts: [] }, s)); this.redraw(); }
    setX(label, format) { this.opts.xLabel = label; this.opts.xFormat = format || "num"; }
    clear() { for (const s of this.series) s.pts = []; }
    // y null/undefined: a gap (nothing measured), not a point.
    push(i, x, y) {
      if (x == null || !isFinite(x)) return;
      const pts = this.series[i].pts, p = [x, y == null || !isFinite(y) ? null : y];
      if (pts.length && pts[pts.length - 1][0] > x) { pts.push(p); pts.sort((a, b) => a[0] - b[0]); }
      else pts.push(p);
    }
    redraw() {
      if (this._queued) return;
      this._queued = true;
      requestAnimationFrame(() => { this._queued = false; this.draw(); });
    }
    draw() {
      const c = this.canvas, dpr = window.devicePixelRatio || 1;
      const w = c.clientWidth || 400, h = c.clientHeight || 240;
      c.width = w * dpr; c.height = h * dpr;
      const g = c.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, w, h);
      g.font = "11px system-ui, sans-serif";
      const pad = { l: 58, r: 12, t: 26, b: 36 };
      const all = this.series.flatMap((s) => s.pts.filter((p) => p[1] != null));
      // The legend's rows first, so the plot starts below them.
      const legend = [];
      let lx = pad.l + 4, ly = 8;
      for (const s of this.series) {
        if (!s.pts.some((p) => p[1] != null)) continue;
        const tw = g.measureText(s.name).width;
        if (lx + 16 + tw > w - pad.r && lx > pad.l + 4) { lx = pad.l + 4; ly += 14; }
        legend.push([s, lx, ly]);
        lx += 24 + tw;
      }
      pad.t = ly + 18;
      c.dataset.points = String(all.length);
      c.dataset.offscale = "0";
      if (!all.length) {
        g.fillStyle = "#94a3b8"; g.textAlign = "center";
        g.fillText(this.opts.empty || "no data yet", w / 2, h / 2);
        return;
      }
      let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
      const ys = all.map((p) => p[1]);
      let [y0, y1] = this.opts.robust ? robustRange(ys) : [Math.min(...ys), Math.max(...ys)];
      if (this.opts.yMin != null) y0 = Math.max(this.opts.yMin, Math.min(y0, this.opts.yMin));
      if (this.opts.yMax != null) y1 = Math.min(this.opts.yMax, Math.max(y1, this.opts.yMax));
      if (this.opts.yMin == null && y0 > 0 && y0 < (y1 - y0)) y0 = 0;
      if (x1 === x0) x1 = x0 + 1;
      if (y1 === y0) {  // a flat line: show it from 0 (or around it, when it is 0)
        if (y0 > 0) y0 = 0; else if (y0 < 0) y1 = 0; else y1 = 1;
      }
      const yt = ticks(y0, y1, 5);
      const lo = Math.min(y0, yt[0]), hi = Math.max(y1, yt[yt.length - 1]);
      const X = (x) => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
      const Y = (y) => h - pad.b - (Math.min(hi, Math.max(lo, y)) - lo) / (hi - lo) * (h - pad.t - pad.b);
      const fmt = FORMATS[this.opts.format] || fmtNum, xfmt = FORMATS[this.opts.xFormat] || fmtNum;
      g.strokeStyle = "#e2e8f0"; g.fillStyle = "#64748b"; g.lineWidth = 1;
      g.textAlign = "right"; g.textBaseline = "middle";
      for (const v of yt) { const y = Math.round(Y(v)) + 0.5; g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke(); g.fillText(fmt(v), pad.l - 6, y); }
      g.textAlign = "center"; g.textBaseline = "top";
      const nx = Math.max(2, Math.min(8, Math.floor((w - pad.l - pad.r) / 70)));
      const xt = this.opts.xFormat === "num" ? ticks(x0, x1, Math.min(nx, Math.max(1, x1 - x0))).filter(Number.isInteger)
        : ticks(x0, x1, nx);
      for (const v of xt) g.fillText(xfmt(v), X(v), h - pad.b + 6);
      g.fillText(this.opts.xLabel || "round", (pad.l + w - pad.r) / 2, h - 13);
      g.strokeStyle = "#94a3b8"; g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, h - pad.b); g.lineTo(w - pad.r, h - pad.b); g.stroke();
      let off = 0;
      for (const s of this.series) {
        if (!s.pts.some((p) => p[1] != null)) continue;
        g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = 2;
        if (s.dash) g.setLineDash(s.dash);
        g.beginPath();
        let pen = false;
        for (const p of s.pts) {
          if (p[1] == null) { pen = false; continue; }  // a gap: nothing measured this round
          if (pen) g.lineTo(X(p[0]), Y(p[1])); else g.moveTo(X(p[0]), Y(p[1]));
          pen = true;
        }
        g.stroke(); g.setLineDash([]);
        const few = s.pts.length <= 60;
        for (const p of s.pts) {
          if (p[1] == null) continue;
          if (p[1] > hi || p[1] < lo) {  // off-scale: a triangle on the edge, pointing out
            off++;
            const x = X(p[0]), y = Y(p[1]), tip = p[1] > hi ? -6 : 6;
            g.beginPath(); g.moveTo(x, y + tip); g.lineTo(x - 5, y); g.lineTo(x + 5, y); g.closePath(); g.fill();
          } else if (few) { g.beginPath(); g.arc(X(p[0]), Y(p[1]), 2.5, 0, 2 * Math.PI); g.fill(); }
        }
      }
      g.textAlign = "left"; g.textBaseline = "middle";
      for (const [s, x, y] of legend) {
        g.fillStyle = s.color; g.fillRect(x, y, 12, 3); g.fillStyle = "#334155"; g.fillText(s.name, x + 16, y + 2);
      }
      c.dataset.offscale = String(off);
      if (off) {  // on the x-label row, right-aligned: never over the data
        g.fillStyle = "#b45309"; g.textAlign = "right"; g.textBaseline = "top";
        g.fillText(off + " point" + (off > 1 ? "s" : "") + " off scale (▲▼ at the edge)", w - pad.r, h - 13);
      }
    }
  }
  window.LineChart = LineChart;
})();
