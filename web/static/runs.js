// Runs list: rows update live from /api/stream (one `run` event per changed run); ticked runs
// open together on /compare.
(function () {
  "use strict";
  const fs = window.fedswarm;
  const picks = () => [...document.querySelectorAll("input.pick:checked")].map((b) => b.value);
  const btn = document.getElementById("compare-btn");
  function updatePicks() {
    if (!btn) return;
    const n = picks().length;
    btn.disabled = n < 1 || n > 8;
    document.getElementById("compare-note").textContent = n > 8 ? "at most 8 runs" : n + " selected";
    document.getElementById("compare-runs").value = picks().join(",");
  }
  document.addEventListener("change", (e) => { if (e.target.classList.contains("pick")) updatePicks(); });
  const form = document.getElementById("compare-form");
  if (form) form.addEventListener("submit", (e) => {
    e.preventDefault();
    location.href = "/compare?runs=" + encodeURIComponent(picks().join(","));
  });
  updatePicks();

  const es = new EventSource("/api/stream");
  es.addEventListener("run", (e) => {
    const r = JSON.parse(e.data);
    const row = document.querySelector('tr[data-run-id="' + CSS.escape(r.id) + '"]');
    if (!row) return;  // not on this page (filters, paging): the list does not jump under the reader
    const cell = (f) => row.querySelector('[data-field="' + f + '"]');
    fs.setBadge(cell("display_status"), r.display_status);
    const bar = cell("progress").querySelector("progress");
    bar.max = r.total_rounds || 1; bar.value = Math.min(r.last_round || 0, r.total_rounds);
    cell("progress").querySelector("span").textContent =
      (r.last_round == null ? "–" : "round " + r.last_round) + "/" + r.total_rounds;
    cell("test_accuracy").textContent = fs.fmtPct(r.test_accuracy);
    cell("best_test_accuracy").textContent = fs.fmtPct(r.best_test_accuracy);
    cell("bytes_up").textContent = fs.fmtBytes(r.bytes_up);
    cell("failed_node_rounds").textContent = r.node_rounds ? r.failed_node_rounds + "/" + r.node_rounds : "–";
  });
})();
