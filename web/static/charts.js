// A small line-chart renderer on <canvas>: axes, nice ticks, several series, a legend.
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
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
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
  const FORMATS = {
    pct: (v) => (100 * v).toFixed(0) + "%",
    bytes: (v) => (window.fedswarm ? window.fedswarm.fmtBytes(v) : fmtNum(v)),
    num: fmtNum,
  };

  class LineChart {
    constructor(canvas, opts) {
      this.canvas = canvas;
      this.opts = Object.assign({ format: "num" }, opts);
      this.series = opts.series.map((s) => Object.assign({ pts: [] }, s));
      this._queued = false;
      if (window.ResizeObserver) new ResizeObserver(() => this.draw()).observe(canvas);
      this.draw();
    }
    push(i, x, y) {
      if (y == null || !isFinite(y)) return;
      const pts = this.series[i].pts;
      if (pts.length && pts[pts.length - 1][0] > x) { pts.push([x, y]); pts.sort((a, b) => a[0] - b[0]); }
      else pts.push([x, y]);
    }
    redraw() {
      if (this._queued) return;
      this._queued = true;
      requestAnimationFrame(() => { this._queued = false; this.draw(); });
    }
    draw() {
      const c = this.canvas, dpr = window.devicePixelRatio || 1;
      const w = c.clientWidth || 400, h = c.clientHeight || 240;
      c.width = Math.round(w * dpr); c.height = Math.round(h * dpr);
      const g = c.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, w, h);
      g.font = "11px system-ui, sans-serif";
      const pad = { l: 58, r: 14, t: 24, b: 30 };
      const all = this.series.flatMap((s) => s.pts);
      c.dataset.points = String(Math.max(0, ...this.series.map((s) => s.pts.length)));
      if (!all.length) {
        g.fillStyle = "#94a3b8"; g.textAlign = "center";
        g.fillText("no rounds yet", w / 2, h / 2);
        return;
      }
      let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
      let y0 = this.opts.yMin != null ? this.opts.yMin : Math.min(...all.map((p) => p[1]));
      let y1 = this.opts.yMax != null ? this.opts.yMax : Math.max(...all.map((p) => p[1]));
      if (this.opts.yMin == null && y0 > 0 && y0 < (y1 - y0)) y0 = 0;
      if (x1 === x0) x1 = x0 + 1;
      if (y1 === y0) { y1 = y0 + (Math.abs(y0) || 1) * 0.1; y0 = y0 - (Math.abs(y0) || 1) * 0.1; }
      const yt = ticks(y0, y1, 5); y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
      const X = (x) => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
      const Y = (y) => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
      const fmt = FORMATS[this.opts.format] || fmtNum;
      g.strokeStyle = "#e2e8f0"; g.fillStyle = "#64748b"; g.lineWidth = 1;
      g.textAlign = "right"; g.textBaseline = "middle";
      for (const v of yt) { const y = Math.round(Y(v)) + 0.5; g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke(); g.fillText(fmt(v), pad.l - 6, y); }
      g.textAlign = "center"; g.textBaseline = "top";
      for (const v of ticks(x0, x1, Math.min(8, x1 - x0)).filter((v) => Number.isInteger(v) || x1 - x0 < 4)) {
        g.fillText(fmtNum(v), X(v), h - pad.b + 6);
      }
      g.fillText(this.opts.xLabel || "round", (pad.l + w - pad.r) / 2, h - 13);
      g.strokeStyle = "#94a3b8"; g.beginPath(); g.moveTo(pad.l, pad.t); g.lineTo(pad.l, h - pad.b); g.lineTo(w - pad.r, h - pad.b); g.stroke();
      let lx = pad.l + 4;
      for (const s of this.series) {
        if (!s.pts.length) continue;
        g.strokeStyle = s.color; g.fillStyle = s.color; g.lineWidth = 2;
        if (s.dash) g.setLineDash(s.dash);
        g.beginPath();
        s.pts.forEach((p, i) => (i ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1]))));
        g.stroke(); g.setLineDash([]);
        if (s.pts.length <= 60) for (const p of s.pts) { g.beginPath(); g.arc(X(p[0]), Y(p[1]), 2.5, 0, 2 * Math.PI); g.fill(); }
        g.textAlign = "left"; g.textBaseline = "middle";
        g.fillRect(lx, 8, 12, 3); g.fillStyle = "#334155"; g.fillText(s.name, lx + 16, 10);
        lx += 24 + g.measureText(s.name).width;
      }
    }
  }
  window.LineChart = LineChart;
})();
