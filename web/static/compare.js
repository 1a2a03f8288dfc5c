// Compare page: each picked run is one series on every chart (accuracy against a chosen x,
// cumulative bytes, loss, consensus distance). Rounds come from /api/runs/{id}/rounds.
(function () {
  "use strict";
  const rows = [...document.querySelectorAll("#compare-table tbody tr")];
  if (!rows.length) return;
  const runs = rows.map((tr, i) => ({ id: tr.dataset.runId, name: tr.dataset.label, color: LineChart.color(i), rounds: [] }));
  rows.forEach((tr, i) => { const s = tr.querySelector(".swatch"); if (s) s.style.background = runs[i].color; });
  const mk = (id, o) => new LineChart(document.getElementById(id), Object.assign({ series: runs.map((r) => ({ name: r.name, color: r.color })) }, o));
  const charts = {
    acc: mk("cmp-acc", { format: "pct", yMin: 0, yMax: 1, robust: false }),
    bytes: mk("cmp-bytes", { format: "bytes" }),
    loss: mk("cmp-loss", {}),
    consensus: mk("cmp-consensus", { empty: "no consensus distance recorded" }),
  };
  const xSel = document.getElementById("cmp-x");
  const AXES = { round: ["round", "num"], wall: ["wall time (s, cumulative)", "sec"],
                 sim: ["simulated time (s, time model)", "sec"], bytes: ["uplink bytes (cumulative)", "bytes"] };

  function draw() {
    for (const c of Object.values(charts)) c.clear();
    const mode = xSel.value;
    charts.acc.setX(AXES[mode][0], AXES[mode][1]);
    let consensus = false;
    runs.forEach((run, i) => {
      let up = 0, wall = 0, sim = 0, simKnown = true;
      for (const r of run.rounds) {
        up += r.bytes_up || 0;
        if (r.round > 0) { wall += r.wall_s || 0; if (r.sim_time_s == null) simKnown = false; else sim += r.sim_time_s; }
        const x = { round: r.round, wall: wall, sim: simKnown ? sim : null, bytes: up }[mode];
        charts.acc.push(i, x, r.test_accuracy);
        charts.bytes.push(i, r.round, up);
        charts.loss.push(i, r.round, r.train_loss);
        const cd = r.metrics ? r.metrics.consensus_distance : undefined;
        if (cd !== undefined) consensus = true;
        charts.consensus.push(i, r.round, cd == null ? null : cd);
      }
    });
    document.getElementById("cmp-fig-consensus").classList.toggle("hidden", !consensus);
    for (const c of Object.values(charts)) c.redraw();
  }
  xSel.addEventListener("change", draw);
  Promise.all(runs.map((run) => fetch("/api/runs/" + encodeURIComponent(run.id) + "/rounds", { credentials: "same-origin" })
    .then((r) => (r.ok ? r.json() : [])).then((rs) => { run.rounds = rs; })))
    .then(() => {
      draw();
      document.getElementById("cmp-note").textContent = runs.length + " runs overlaid; " +
        runs.map((r) => r.rounds.length).reduce((a, b) => a + b, 0) + " rounds in all.";
    })
    .catch(() => { document.getElementById("cmp-note").textContent = "Could not load the rounds."; });
})();
