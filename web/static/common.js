// Shared helpers for the dashboard pages (no dependencies).
(function () {
  "use strict";
  function fmtBytes(n) {
    if (n == null) return "–";
    const u = [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"]];
    for (const [s, name] of u) if (Math.abs(n) >= s) return (n / s).toFixed(s >= 1e6 ? 2 : 1) + " " + name;
    return Math.round(n) + " B";
  }
  function fmtPct(x) { return x == null ? "–" : (100 * x).toFixed(1) + "%"; }
  function setBadge(el, status) {
    if (!el) return;
    el.innerHTML = "";
    const span = document.createElement("span");
    span.className = "badge s-" + status;
    span.textContent = status;
    el.appendChild(span);
  }
  function csrf() {
    const m = document.querySelector('meta[name="csrf-token"]');
    return m ? m.content : "";
  }
  window.fedswarm = { fmtBytes, fmtPct, setBadge, csrf };
})();
