// A small line-chart renderer on <canvas>: axes, nice ticks, several series, a legend.
// Axes are outlier-robust: with enough points, the y range is the data's interquartile range
// widened by 3 IQR (never past the data); points beyond it are drawn as triangles on the edge
// and counted in a note, so one bad round cannot flatten every other point. A missing value
// (null) is a gap in the line, never a zero.
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
  function quantile(sorted, q) {
    const i = (sorted.length - 1) * q, lo = Math.floor(i), hi = Math.ceil(i);
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (i - lo);
  }
  // The y range to draw: robust to outliers when there are enough points.
  function robustRange(ys) {
    const s = ys.slice().sort((a, b) => a - b), min = s[0], max = s[s.length - 1];
    if (s.length < 8) return [min, max];
    const q1 = quantile(s, 0.25), q3 = quantile(s, 0.75), iqr = q3 - q1;
    const pad = iqr > 0 ? 3 * iqr : Math.max(Math.abs(q3) * 0.5, 1e-12);
    return [Math.max(min, q1 - pad), Math.min(max, q3 + pad)];
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
      if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1) * 0.1; y0 = y0 - (Math.abs(y0) || 1) * 0.1; }
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
      const xt = ticks(x0, x1, nx).filter((v) => this.opts.xFormat !== "num" || Number.isInteger(v) || x1 - x0 < 4);
      for (const v of xt) g.fillText(xfmt(v), X(v), h - pad.b + 6);
      g.fillText(this.opts.xLabel || "round", (pad.l + w - pad.r) / 2, h - 13);
      g.strokeStyle = "#94a3b8"; g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, h - pad.b); g.lineTo(w - pad.r, h - pad.b); g.stroke();
      let off = 0, lx = pad.l + 4, ly = 8;
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
        g.textAlign = "left"; g.textBaseline = "middle";
        const tw = g.measureText(s.name).width;
        if (lx + 16 + tw > w - pad.r && lx > pad.l + 4) { lx = pad.l + 4; ly += 13; }
        g.fillRect(lx, ly, 12, 3); g.fillStyle = "#334155"; g.fillText(s.name, lx + 16, ly + 2);
        lx += 24 + tw;
      }
      c.dataset.offscale = String(off);
      if (off) {
        g.fillStyle = "#b45309"; g.textAlign = "right"; g.textBaseline = "top";
        g.fillText(off + " point" + (off > 1 ? "s" : "") + " off scale ▲", w - pad.r, h - pad.b - 14);
      }
    }
  }
  window.LineChart = LineChart;
})();
