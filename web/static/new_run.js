// New-run form: show only the chosen strategy's hyperparameters (the others are not posted).
(function () {
  "use strict";
  const sel = document.getElementById("strategy");
  if (!sel || sel.tagName !== "SELECT") return;
  function update() {
    for (const fs of document.querySelectorAll("fieldset.hp")) {
      const on = fs.dataset.strategy === sel.value;
      fs.hidden = !on;
      for (const el of fs.querySelectorAll("input, select, textarea")) el.disabled = !on;
    }
  }
  sel.addEventListener("change", update);
  update();
})();
