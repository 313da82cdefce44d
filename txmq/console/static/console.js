// txmq console: refresh a page's live part every few seconds, and ask before an action.
// (No inline script anywhere: the Content-Security-Policy allows only this file.)
(function () {
  "use strict";

  var status = null;
  var busy = false;

  function say(text) {
    if (status) status.textContent = text;
  }

  function refresh(live) {
    if (busy || document.hidden) return;
    busy = true;
    var url = new URL(window.location.href);
    url.searchParams.set("partial", "1");
    url.searchParams.delete("flash");
    fetch(url.toString(), { credentials: "same-origin", cache: "no-store" })
      .then(function (response) {
        return response.text().then(function (html) {
          live.innerHTML = html; // server-rendered and escaped: an error is a fragment too
          live.dataset.updated = String(Date.now());
          say((response.ok ? "updated " : "refresh failed (" + response.status + ") ")
              + new Date().toLocaleTimeString());
        });
      })
      .catch(function (err) {
        say("console unreachable: " + err.message);
      })
      .finally(function () {
        busy = false;
      });
  }

  // forms with data-confirm ask first; the server wants confirm=yes as well
  document.addEventListener("submit", function (event) {
    var form = event.target;
    if (!(form instanceof HTMLFormElement)) return;
    var question = form.getAttribute("data-confirm");
    if (!question) return;
    if (!window.confirm(question)) {
      event.preventDefault();
      return;
    }
    var field = form.querySelector("input[name=confirm]");
    if (field) field.value = "yes";
  });

  document.addEventListener("DOMContentLoaded", function () {
    status = document.getElementById("live-status");
    var live = document.querySelector("[data-live]");
    if (!live) return;
    var every = Number(document.body.getAttribute("data-refresh")) || 3000;
    window.setInterval(function () { refresh(live); }, every);
  });
})();
