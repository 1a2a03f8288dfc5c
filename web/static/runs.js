// Runs list: rows update live from /api/stream (one `run` event per changed run).
(function () {
  "use strict";
  const fs = window.fedswarm;
  let reloading = false;
  const es = new EventSource("/api/stream");
  es.addEventListener("run", (e) => {
    const r = JSON.parse(e.data);
    const row = document.querySelector('tr[data-run-id="' + CSS.escape(r.id) + '"]');
    if (!row) {
      if (!reloading) { reloading = true; setTimeout(() => location.reload(), 500); }
      return;
    }
    const cell = (f) => row.querySelector('[data-field="' + f + '"]');
    fs.setBadge(cell("display_status"), r.display_status);
    const bar = cell("progress").querySelector("progress");
    bar.max = r.total_rounds || 1; bar.value = r.rounds_done;
    cell("progress").querySelector("span").textContent = r.rounds_done + "/" + r.total_rounds;
    cell("test_accuracy").textContent = fs.fmtPct(r.test_accuracy);
    cell("best_test_accuracy").textContent = fs.fmtPct(r.best_test_accuracy);
    cell("bytes_up").textContent = fs.fmtBytes(r.bytes_up);
    cell("bytes_down").textContent = fs.fmtBytes(r.bytes_down);
  });
})();
