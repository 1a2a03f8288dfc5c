// Starts Swagger UI on /docs from the locally served bundle (no inline script: strict CSP).
(function () {
  "use strict";
  if (!window.SwaggerUIBundle) return;
  const missing = document.getElementById("docs-missing");
  if (missing) missing.remove();
  window.ui = window.SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [window.SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
    validatorUrl: null,
  });
})();
