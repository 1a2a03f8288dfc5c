// Run page: live charts fed by server-sent events (/api/runs/{id}/stream), the shown status
// with why (lost, degraded), buttons enabled only when their action is valid, pending controls.
(function () {
  "use strict";
  const root = document.getElementById("run");
  if (!root) return;
  const runId = root.dataset.runId, fs = window.fedswarm;
  const rounds = new Map();  // round number -> row, as received
  const C = (id, o) => new LineChart(document.getElementById(id), o);
  const charts = {
    acc: C("chart-acc", { format: "pct", yMin: 0, yMax: 1, robust: false, series: [{ name: "test accuracy", color: "#2563eb" },
      { name: "federated accuracy (nodes' own data)", color: "#16a34a", dash: [5, 3] }] }),
    loss: C("chart-loss", { series: [{ name: "train loss", color: "#d97706" }, { name: "test loss", color: "#9333ea" }] }),
    bytes: C("chart-bytes", { format: "bytes", series: [{ name: "up", color: "#0d9488" }, { name: "down", color: "#64748b", dash: [5, 3] },
      { name: "model reports (monitoring, not in up)", color: "#d97706", dash: [2, 3] }] }),
    time: C("chart-time", { format: "sec", series: [{ name: "wall", color: "#dc2626" }, { name: "simulated (time model)", color: "#16a34a", dash: [5, 3] }] }),
    consensus: C("chart-consensus", { empty: "no consensus distance recorded", series: [{ name: "consensus distance", color: "#9333ea" }] }),
    failed: C("chart-failed", { empty: "no per-node rows yet", series: [{ name: "failed or rejected", color: "#dc2626" }, { name: "nodes", color: "#94a3b8", dash: [4, 3] }] }),
    // asynchronous runs (FedBuff): a recorded round is a model version
    staleness: C("chart-staleness", { empty: "no staleness recorded", series: [{ name: "max", color: "#dc2626" },
      { name: "mean", color: "#2563eb" }, { name: "min", color: "#16a34a", dash: [4, 3] }] }),
    inflight: C("chart-inflight", { empty: "no nodes in flight recorded", series: [{ name: "nodes in flight", color: "#0d9488" }] }),
  };
  // An asynchronous run records model versions, not rounds (metrics.model_version): the page says so.
  let asyncRun = false;
  function markAsync() {
    if (asyncRun) return;
    asyncRun = true;
    X_AXES.round[0] = "model version";
    const opt = document.getElementById("acc-x-round");
    if (opt) opt.textContent = "model version";
    for (const [k, c] of Object.entries(charts)) if (k !== "acc") c.setX("model version");
    document.getElementById("cap-failed").textContent = "Nodes failed or rejected per model version";
    document.getElementById("fig-staleness").classList.remove("hidden");
    document.getElementById("fig-inflight").classList.remove("hidden");
  }
  const note = document.getElementById("live-note");
  const progress = document.getElementById("progress-text");
  const xSel = document.getElementById("acc-x");
  const X_AXES = {
    round: ["round", "num"], wall: ["wall time (s, cumulative)", "sec"],
    sim: ["simulated time (s, time model)", "sec"], bytes: ["uplink bytes (cumulative)", "bytes"],
  };
  let total = +root.dataset.total;

  // Every chart is rebuilt from the rounds received (cheap: a run has at most thousands).
  function rebuild() {
    for (const c of Object.values(charts)) c.clear();
    const rows = [...rounds.values()].sort((a, b) => a.round - b.round);
    let up = 0, down = 0, report = 0, anyReport = false, wall = 0, sim = 0, simKnown = true, anyConsensus = false;
    const mode = xSel ? xSel.value : "round";
    const [xl, xf] = X_AXES[mode];
    charts.acc.setX(xl, xf);
    for (const r of rows) {
      up += r.bytes_up || 0; down += r.bytes_down || 0;
      if (r.round > 0) { wall += r.wall_s || 0; if (r.sim_time_s == null) simKnown = false; else sim += r.sim_time_s; }
      const x = { round: r.round, wall: wall, sim: simKnown ? sim : null, bytes: up }[mode];
      charts.acc.push(0, x, r.test_accuracy);
      charts.acc.push(1, x, r.fed_accuracy);
      charts.loss.push(0, r.round, r.train_loss);
      charts.loss.push(1, r.round, r.test_loss);
      charts.bytes.push(0, r.round, up);
      charts.bytes.push(1, r.round, down);
      const rep = r.metrics ? r.metrics.bytes_report : undefined;  // decentralized nodes' model reports
      if (rep != null) { anyReport = true; report += rep; }
      charts.bytes.push(2, r.round, anyReport ? report : null);
      if (r.round > 0) { charts.time.push(0, r.round, r.wall_s); charts.time.push(1, r.round, r.sim_time_s); }
      const cd = r.metrics ? r.metrics.consensus_distance : undefined;
      if (cd !== undefined) anyConsensus = true;
      charts.consensus.push(0, r.round, cd == null ? null : cd);  // none yet: a gap, never 0
      if (r.node_rows) { charts.failed.push(0, r.round, r.failed_node_rows || 0); charts.failed.push(1, r.round, r.node_rows); }
      const m = r.metrics || {};
      if (m.model_version !== undefined) {
        markAsync();
        charts.staleness.push(0, r.round, m.staleness_max);
        charts.staleness.push(1, r.round, m.staleness_mean);
        charts.staleness.push(2, r.round, m.staleness_min);
        charts.inflight.push(0, r.round, m.in_flight);
      }
    }
    if (anyConsensus) document.getElementById("fig-consensus").classList.remove("hidden");
    for (const c of Object.values(charts)) c.redraw();
  }
  if (xSel) xSel.addEventListener("change", rebuild);

  function showProgress(last) {
    const unit = asyncRun ? "model version" : "round";
    progress.textContent = last == null ? "no " + unit + " yet, " + total + " planned" : unit + " " + last + " of " + total;
  }

  function onRound(r) {
    if (rounds.has(r.round)) return;
    rounds.set(r.round, r);
    rebuild();
    refreshNodes(false);
    showProgress(Math.max(...rounds.keys()));
    note.textContent = "Live: round " + r.round + " received " + new Date().toLocaleTimeString() +
      (r.test_accuracy != null ? " · accuracy " + fs.fmtPct(r.test_accuracy) : "");
  }

  // The node and device-class tables: refreshed from /api/runs/{id} at most every 5 s.
  let lastNodes = 0;
  function refreshNodes(force) {
    if (!force && Date.now() - lastNodes < 5000) return;
    lastNodes = Date.now();
    fetch("/api/runs/" + encodeURIComponent(runId), { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null))
      .then((d) => {
        if (!d) return;
        fill("nodes-body", d.nodes, (n) => [n.node_id, n.device_class || "–", n.rounds, fs.fmtBytes(n.bytes_up),
          fs.fmtBytes(n.bytes_down), n.rejected, n.failed, n.last_seen ? n.last_seen.replace("T", " ").slice(0, 19) : "round " + n.last_round,
          fs.fmtPct(n.fed_accuracy), n.device || "–"],
          (i) => (i >= 2 && i <= 6) || i === 8);
        fill("classes-body", d.device_classes, (c) => [c.device_class, c.nodes, c.node_rounds, c.failed, c.rejected,
          fs.fmtBytes(c.bytes_up), fs.fmtBytes(c.bytes_down), JSON.stringify(d.policies[c.device_class] || {})],
          (i) => i >= 1 && i <= 6);
        document.getElementById("nodes-table").classList.toggle("hidden", !d.nodes.length);
        document.getElementById("nodes-empty").classList.toggle("hidden", !!d.nodes.length);
        showPending(d.controls.filter((c) => !c.applied_at));
      })
      .catch(() => {});
  }
  function fill(id, items, cells, numeric) {
    const body = document.getElementById(id);
    if (!body || !items.length) return;
    body.innerHTML = "";
    for (const it of items) {
      const tr = document.createElement("tr");
      cells(it).forEach((v, i) => {
        const td = document.createElement("td");
        td.textContent = String(v);
        if (numeric(i)) td.className = "num";
        tr.appendChild(td);
      });
      body.appendChild(tr);
    }
  }

  function showPending(controls) {
    const box = document.getElementById("pending"), list = document.getElementById("pending-list");
    if (!box) return;
    box.classList.toggle("hidden", !controls.length);
    list.innerHTML = "";
    for (const c of controls) {
      const li = document.createElement("li");
      let what = c.kind;
      if (c.kind === "policy") what += " (" + c.payload.device_class + ": " + JSON.stringify(c.payload.policy) + ")";
      if (c.kind === "add_rounds") what += " (+" + c.payload.rounds + ")";
      li.textContent = what + " — requested by " + (c.actor || "?") + " at " + (c.created_at || "").replace("T", " ").slice(0, 19);
      list.appendChild(li);
    }
  }

  // Buttons: enabled exactly when the server says the action is valid (its reason as tooltip).
  function setButtons(actions) {
    for (const [action, why] of Object.entries(actions || {})) {
      const b = document.getElementById("btn-" + action);
      if (!b) continue;
      b.disabled = why != null;
      b.title = why || "";
    }
  }

  function onStatus(s) {
    total = s.total_rounds;
    fs.setBadge(document.getElementById("status"), s.display_status);
    if (s.actions) setButtons(s.actions);
    const err = document.getElementById("run-error");
    if (s.error) { err.textContent = s.error; err.classList.remove("hidden"); }
    const lost = document.getElementById("lost-note");
    if (s.lost_reason !== undefined) {
      lost.classList.toggle("hidden", !s.lost_reason);
      document.getElementById("lost-reason").textContent = s.lost_reason || "";
    }
    if (s.failed_node_rounds) {
      document.getElementById("health-note").classList.remove("hidden");
      document.getElementById("health-text").textContent = s.failed_node_rounds + " of " + s.node_rounds +
        " node-rounds failed or were rejected; most nodes failed in " + s.bad_rounds + " of " + s.rounds_with_nodes + " rounds";
    }
    showProgress(s.last_round != null ? s.last_round : (rounds.size ? Math.max(...rounds.keys()) : null));
    refreshNodes(true);
    if (!["pending", "running", "paused"].includes(s.display_status)) {
      fetch("/api/runs/" + encodeURIComponent(runId) + "/log", { credentials: "same-origin" })
        .then((r) => (r.ok ? r.json() : null))
        .then((j) => { if (j && j.log) document.getElementById("log").textContent = j.log; })
        .catch(() => {});
    }
  }

  const controls = document.getElementById("controls");
  if (controls && controls.dataset.state) setButtons(JSON.parse(controls.dataset.state).actions);
  const es = new EventSource("/api/runs/" + encodeURIComponent(runId) + "/stream");
  es.addEventListener("round", (e) => onRound(JSON.parse(e.data)));
  es.addEventListener("status", (e) => onStatus(JSON.parse(e.data)));
  es.onerror = () => { note.textContent = "Live updates interrupted; reconnecting…"; };
  es.onopen = () => { if (!rounds.size) note.textContent = "Live: connected, waiting for rounds…"; };
})();
