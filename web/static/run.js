// Run page: live charts fed by server-sent events (/api/runs/{id}/stream).
(function () {
  "use strict";
  const root = document.getElementById("run");
  if (!root) return;
  const runId = root.dataset.runId, fs = window.fedswarm;
  let total = +root.dataset.total, cumUp = 0, cumDown = 0, lastRound = null;
  const seen = new Set();
  const charts = {
    acc: new LineChart(document.getElementById("chart-acc"), { format: "pct", yMin: 0, yMax: 1,
      series: [{ name: "test accuracy", color: "#2563eb" }] }),
    loss: new LineChart(document.getElementById("chart-loss"), {
      series: [{ name: "train loss", color: "#d97706" }, { name: "test loss", color: "#9333ea" }] }),
    bytes: new LineChart(document.getElementById("chart-bytes"), { format: "bytes",
      series: [{ name: "up", color: "#0d9488" }, { name: "down", color: "#64748b", dash: [5, 3] }] }),
    time: new LineChart(document.getElementById("chart-time"), {
      series: [{ name: "wall s", color: "#dc2626" }, { name: "simulated s", color: "#16a34a", dash: [5, 3] }] }),
  };
  const note = document.getElementById("live-note");
  const progress = document.getElementById("progress-text");

  function onRound(r) {
    if (seen.has(r.round)) return;
    seen.add(r.round);
    charts.acc.push(0, r.round, r.test_accuracy);
    charts.loss.push(0, r.round, r.train_loss);
    charts.loss.push(1, r.round, r.test_loss);
    cumUp += r.bytes_up || 0; cumDown += r.bytes_down || 0;
    charts.bytes.push(0, r.round, cumUp);
    charts.bytes.push(1, r.round, cumDown);
    if (r.round > 0) { charts.time.push(0, r.round, r.wall_s); charts.time.push(1, r.round, r.sim_time_s); }
    for (const c of Object.values(charts)) c.redraw();
    refreshNodes(false);
    lastRound = Math.max(lastRound == null ? r.round : lastRound, r.round);
    const done = [...seen].filter((x) => x > 0).length;
    progress.textContent = done + "/" + total + " rounds";
    note.textContent = "Live: round " + r.round + " received " + new Date().toLocaleTimeString() +
      (r.test_accuracy != null ? " · accuracy " + fs.fmtPct(r.test_accuracy) : "");
  }

  // The per-node table: refreshed from /api/runs/{id} at most every 5 s, and when the run ends.
  let lastNodes = 0;
  function refreshNodes(force) {
    if (!force && Date.now() - lastNodes < 5000) return;
    lastNodes = Date.now();
    fetch("/api/runs/" + encodeURIComponent(runId), { credentials: "same-origin" })
      .then((r) => (r.ok ? r.json() : null))
      .then((d) => {
        if (!d) return;
        const body = document.getElementById("nodes-body");
        body.innerHTML = "";
        for (const n of d.nodes) {
          const tr = document.createElement("tr");
          const cells = [n.node_id, n.device_class || "–", n.rounds, fs.fmtBytes(n.bytes_up), fs.fmtBytes(n.bytes_down),
                         n.rejected, n.failed, n.last_seen ? n.last_seen.replace("T", " ").slice(0, 19) : "round " + n.last_round];
          cells.forEach((v, i) => {
            const td = document.createElement("td");
            td.textContent = String(v);
            if (i >= 2 && i <= 6) td.className = "num";
            if (i === 5 && n.last_reason) td.title = n.last_reason;
            tr.appendChild(td);
          });
          body.appendChild(tr);
        }
        document.getElementById("nodes-table").classList.toggle("hidden", !d.nodes.length);
        document.getElementById("nodes-empty").classList.toggle("hidden", !!d.nodes.length);
      })
      .catch(() => {});
  }

  function setButtons(status) {
    const on = (id, yes) => { const b = document.getElementById(id); if (b) b.disabled = !yes; };
    const live = ["pending", "running", "paused"].includes(status);
    on("btn-pause", status === "running" || status === "pending");
    on("btn-resume", status === "paused" || status === "running");
    on("btn-stop", live || status === "lost");
    on("btn-kill", live);
  }

  function onStatus(s) {
    total = s.total_rounds;
    fs.setBadge(document.getElementById("status"), s.display_status);
    setButtons(s.display_status);
    const err = document.getElementById("run-error");
    if (s.error) { err.textContent = s.error; err.classList.remove("hidden"); }
    progress.textContent = [...seen].filter((x) => x > 0).length + "/" + total + " rounds";
    if (!["pending", "running", "paused"].includes(s.display_status)) {
      refreshNodes(true);
      fetch("/api/runs/" + encodeURIComponent(runId) + "/log", { credentials: "same-origin" })
        .then((r) => (r.ok ? r.json() : null))
        .then((j) => { if (j && j.log) document.getElementById("log").textContent = j.log; })
        .catch(() => {});
    }
  }

  const badge = document.querySelector("#status .badge");
  if (badge) setButtons(badge.textContent.trim());
  const es = new EventSource("/api/runs/" + encodeURIComponent(runId) + "/stream");
  es.addEventListener("round", (e) => onRound(JSON.parse(e.data)));
  es.addEventListener("status", (e) => onStatus(JSON.parse(e.data)));
  es.onerror = () => { note.textContent = "Live updates interrupted; reconnecting…"; };
  es.onopen = () => { if (!seen.size) note.textContent = "Live: connected, waiting for rounds…"; };
})();
