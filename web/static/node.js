// Node page: the node's telemetry over its rounds (GET /api/nodes/{id}, without asking the
// SuperLink again: the page already shows its state), drawn with charts.js.
// x is the node's n-th round (oldest first, across runs); a round that measured nothing is a gap.
(function () {
  "use strict";
  const root = document.getElementById("node");
  if (!root) return;
  const C = (id, o) => new LineChart(document.getElementById(id), o);
  const charts = {
    train: C("chart-train", { format: "sec", empty: "no training time reported", series: [{ name: "train s", color: "#2563eb" }] }),
    mem: C("chart-mem", { empty: "no memory reported", series: [{ name: "peak RSS MB", color: "#9333ea" }] }),
    battery: C("chart-battery", { yMin: 0, yMax: 100, robust: false, empty: "no battery reported", series: [{ name: "battery %", color: "#16a34a" }] }),
    temp: C("chart-temp", { empty: "no temperature reported", series: [{ name: "CPU °C", color: "#dc2626" }] }),
    bytes: C("chart-bytes", { format: "bytes", empty: "no rounds yet", series: [{ name: "up", color: "#0d9488" }, { name: "down", color: "#64748b", dash: [5, 3] }] }),
  };
  for (const c of Object.values(charts)) c.setX("round of this node (oldest first)", "num");
  fetch("/api/nodes/" + encodeURIComponent(root.dataset.nodeId) + "?supernodes=false", { credentials: "same-origin" })
    .then((r) => (r.ok ? r.json() : null))
    .then((d) => {
      if (!d) return;
      d.rounds.forEach((r, i) => {
        const t = r.telemetry || {}, x = i + 1;
        charts.train.push(0, x, t.train_s);
        charts.mem.push(0, x, t.peak_rss_mb);
        charts.battery.push(0, x, t.battery_pct);
        charts.temp.push(0, x, t.cpu_temp_c);
        charts.bytes.push(0, x, r.bytes_up);
        charts.bytes.push(1, x, r.bytes_down);
      });
      for (const c of Object.values(charts)) c.redraw();
    })
    .catch(() => {});
})();
