// The iopd console: follow /events and rebuild the tables in place; drive the
// runtime controls.  The server renders the first page (templates/console/index.html):
// each render function here writes the same rows.  Every text goes through
// textContent, never innerHTML: error messages may quote what a caller sent.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) node.setAttribute(k, String(v));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function utcClock(unix) {
    if (unix === null || unix === undefined) return "-";
    return new Date(unix * 1000).toISOString().slice(0, 19).replace("T", " ") + "Z";
  }

  function td(label, attrs, ...children) {
    return el("td", Object.assign({ "data-label": label }, attrs || {}), ...children);
  }

  function button(action, idAttr, id, text) {
    return el("button", { type: "button", "data-action": action, [idAttr]: id }, text);
  }

  function replaceRows(tbodyId, rows, emptyText, columns) {
    const body = $(tbodyId);
    if (!body) return;
    if (rows.length === 0 && emptyText) {
      rows = [el("tr", { class: "empty" }, el("td", { colspan: columns }, emptyText))];
    }
    body.replaceChildren(...rows);
  }

  function providerRow(p) {
    const state = el("td", { "data-label": "State" },
      el("span", { class: "badge state-" + p.state, "data-field": "state" }, p.state));
    if (p.override) {
      const parts = Object.entries(p.override).map(([k, v]) => k + "=" + v);
      state.append(" ", el("small", { "data-field": "override" }, "override " + parts.join(", ")));
    }
    return el("tr", { "data-provider": p.id },
      td("Provider", null, el("strong", { class: "pid" }, p.id), " ",
        el("small", null, p.type + " on " + p.node_id)),
      td("Health", null, el("span", { class: "badge health-" + p.health, "data-field": "health" }, p.health)),
      state,
      td("In flight", { "data-field": "in-flight" }, p.in_flight + " / " + p.capacity),
      td("Load", null, el("meter", { min: 0, max: 1, value: Math.min(p.load_ratio, 1) }), " ",
        el("span", { "data-field": "load" }, Math.round(p.load_ratio * 100) + "%")),
      td("Queue", { "data-field": "queued" }, p.queued),
      td("Index (blocks)", { "data-field": "index-blocks" }, p.index_blocks === null ? "-" : p.index_blocks),
      td("Hit rate", { "data-field": "hit-rate" }, p.hit_rate === null ? "-" : Math.round(p.hit_rate * 100) + "%"),
      td("Last error", { class: "err", "data-field": "last-error" }, p.last_error || "-"),
      providerActions(p));
  }

  // The buttons the view offers in this state (view.py ACTIONS): never one for what is already so.
  function providerActions(p) {
    const cell = td("Actions", { class: "actions" });
    for (const action of p.actions) {
      cell.append(" ", button(action, "data-provider-id", p.id, action[0].toUpperCase() + action.slice(1)));
    }
    if (p.disabled_in_config) cell.append(el("small", null, "disabled in the config"));
    return cell;
  }

  function nodeRow(n) {
    const name = td("Node", null, el("strong", null, n.id));
    if (n.alias) name.append(" ", el("small", null, n.alias));
    return el("tr", { "data-node": n.id },
      name,
      td("Connected", null, el("span", {
        class: "badge " + (n.connected ? "health-healthy" : "health-disconnected"),
        "data-field": "connected",
      }, n.connected ? "connected" : "disconnected")),
      td("Since", { "data-field": "since" }, utcClock(n.connected_since)),
      td("Providers", null, n.providers.join(", ")),
      td("Actions", { class: "actions" },
        n.drainable ? button("node-drain", "data-node-id", n.id, "Drain node") : null));
  }

  function groupRow(g) {
    const name = td("Model group", null, el("strong", null, g.id));
    if (g.source !== "models") name.append(" ", el("small", null, g.source));
    const providers = td("Providers", { "data-field": "providers" });
    for (const gp of g.providers) {
      const item = el("span", { class: "gp", "data-group-provider": gp.provider },
        gp.provider + " → " + gp.served + " ",
        el("span", { class: "badge health-" + gp.health }, gp.health));
      if (gp.state !== "active") item.append(" ", el("span", { class: "badge state-" + gp.state }, gp.state));
      providers.append(item);
    }
    if (g.providers.length === 0) providers.append("-");
    return el("tr", { "data-group": g.id },
      name, providers,
      td("Policy", { "data-field": "policy" }, g.policy),
      td("Routing", { "data-field": "routing" }, g.routing),
      td("Waiting", { "data-field": "queued" }, g.queued));
  }

  function usageRow(u) {
    return el("tr", null,
      td("Principal", null, u.principal), td("Model", null, u.model),
      td("Req/min", null, u.requests_per_min), td("Tokens/min", null, u.tokens_per_min),
      td("Requests", null, u.requests), td("Tokens", null, u.tokens), td("Errors", null, u.errors));
  }

  function errorRow(e) {
    return el("tr", null,
      td("Time", null, utcClock(e.time)), td("Status", null, e.status || "-"), td("Code", null, e.code),
      td("Model", null, e.model), td("Principal", null, e.principal), td("Provider", null, e.provider),
      td("Message", { class: "err" }, e.message || "-"));
  }

  function render(view) {
    $("edge-id").textContent = view.edge_id;
    $("config-version").textContent = view.config_version;
    $("queue-depth").textContent = view.queue.depth;
    $("queue-max").textContent = view.queue.max_queue;
    $("usage-minutes").textContent = view.usage_minutes;
    replaceRows("providers", view.providers.map(providerRow));
    replaceRows("nodes", view.nodes.map(nodeRow));
    replaceRows("groups", view.groups.map(groupRow));
    replaceRows("usage", view.usage.map(usageRow), "no requests yet", 7);
    replaceRows("errors", view.errors.map(errorRow), "no errors", 7);
  }

  // ------------------------------------------------------------ notices

  let noticeTimer = null;

  function notice(text, isError) {
    const box = $("notice");
    box.textContent = text;
    box.className = "notice " + (isError ? "notice-error" : "notice-ok");
    box.hidden = false;
    clearTimeout(noticeTimer);
    noticeTimer = setTimeout(() => { box.hidden = true; }, isError ? 15000 : 4000);
  }

  // An error answer: the OpenAI envelope {"error": {"message", "code"}} when there is one.
  async function errorText(response) {
    let text = "HTTP " + response.status;
    try {
      const body = await response.json();
      if (body && body.error) {
        const err = body.error;
        text += (err.code ? " " + err.code : "") + ": " + (err.message || JSON.stringify(err));
      }
    } catch (_) {
      // not JSON: the status says it
    }
    return text;
  }

  // ------------------------------------------------------------ controls

  const PROVIDER_STATES = { drain: "draining", disable: "disabled", enable: "active" };

  function controlRequest(button) {
    const action = button.dataset.action;
    if (action === "node-drain") {
      const id = button.dataset.nodeId;
      return { what: "node " + id, url: "/nodes/" + encodeURIComponent(id) + "/drain", body: {} };
    }
    const id = button.dataset.providerId;
    const state = PROVIDER_STATES[action];
    if (!id || !state) return null;
    return {
      what: "provider " + id + " → " + state,
      url: "/providers/" + encodeURIComponent(id) + "/state",
      body: { state: state },
    };
  }

  async function control(button) {
    const req = controlRequest(button);
    if (!req) return;
    button.disabled = true;
    try {
      const response = await fetch(req.url, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "application/json" },
        body: JSON.stringify(req.body),
      });
      if (response.ok) {
        notice(req.what + ": done", false);
      } else {
        notice(req.what + ": " + (await errorText(response)), true);
      }
    } catch (err) {
      notice(req.what + ": " + err, true);
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------ confirmation

  // A drain changes where traffic goes until someone enables the provider again:
  // it is asked for once more, in the page's own dialog (no window.confirm).
  function confirmText(button) {
    const action = button.dataset.action;
    if (action === "drain") {
      const id = button.dataset.providerId;
      return {
        title: "Drain provider " + id + "?",
        detail: "It takes no new requests; the requests in flight finish. Enable turns it back on.",
        ok: "Drain " + id,
      };
    }
    if (action === "node-drain") {
      const id = button.dataset.nodeId;
      return {
        title: "Drain every provider of node " + id + "?",
        detail: "They take no new requests; the requests in flight finish. Enable turns each back on.",
        ok: "Drain node " + id,
      };
    }
    return null;
  }

  function confirmed(text) {
    const dialog = $("confirm");
    if (!dialog || !dialog.showModal) return Promise.resolve(true);
    $("confirm-title").textContent = text.title;
    $("confirm-detail").textContent = text.detail;
    $("confirm-ok").textContent = text.ok;
    return new Promise((resolve) => {
      const done = (ok) => {
        dialog.onclose = null;
        $("confirm-ok").onclick = null;
        $("confirm-cancel").onclick = null;
        if (dialog.open) dialog.close();
        resolve(ok);
      };
      $("confirm-ok").onclick = () => done(true);
      $("confirm-cancel").onclick = () => done(false);
      dialog.onclose = () => done(false); // Escape
      dialog.showModal();
    });
  }

  document.addEventListener("click", async (event) => {
    const target = event.target instanceof Element ? event.target.closest("button[data-action]") : null;
    if (!target) return;
    const text = confirmText(target);
    if (text && !(await confirmed(text))) return;
    control(target);
  });

  // ------------------------------------------------------------ live

  function follow() {
    const live = $("live");
    const url = document.body.dataset.eventsUrl;
    if (!url || !window.EventSource) return;
    const source = new EventSource(url, { withCredentials: true });
    source.onopen = () => { live.textContent = "live"; live.className = "live live-on"; };
    source.onerror = () => { live.textContent = "reconnecting"; live.className = "live live-off"; };
    source.addEventListener("status", (event) => {
      try {
        render(JSON.parse(event.data));
      } catch (err) {
        notice("console update failed: " + err, true);
      }
    });
  }

  follow();
})();
