// Leveret's web console: a few views over the management API (same origin, basic auth).
// Everything shown is built with textContent (names come from clients: never innerHTML).
"use strict";

// gen: each route() call's number (an answer for an older one is dropped); shown: the hash the page shows.
const state = { auth: sessionStorage.getItem("leveret-auth"), timer: null, sort: {}, gen: 0, shown: null,
  lists: {} };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(String(c ?? "")));
  return node;
}

async function api(method, path, body, headers) {
  const res = await fetch("/api" + path, {
    method, headers: { Authorization: "Basic " + state.auth, "Content-Type": "application/json",
      "X-Requested-With": "XMLHttpRequest", ...(headers || {}) },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 401) { logout("Login failed or not allowed: " + path); throw new Error("401"); }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new Error((data && data.reason) || res.statusText);
  return data;
}

const enc = encodeURIComponent;
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n || 0), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i ? v.toFixed(1) : String(v)) + " " + units[i];
}
const rate = (stats, key) => ((stats || {})[key + "_details"] || {}).rate || 0;
const main = () => document.getElementById("main");

function logout(message) {
  sessionStorage.removeItem("leveret-auth");
  state.auth = null;
  location.hash = "";
  location.reload();
  if (message) sessionStorage.setItem("leveret-login-error", message);
}

function table(id, columns, rows, key) {
  // columns: [label, getter, numeric]; rows sorted by the clicked column (client side).
  const sort = state.sort[key] || { col: 0, rev: false };
  const sorted = [...rows].sort((a, b) => {
    const x = columns[sort.col][1](a), y = columns[sort.col][1](b);
    const r = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
    return sort.rev ? -r : r;
  });
  const head = el("tr", {}, columns.map(([label, , num], i) => el("th", {
    class: num ? "num" : "", onclick: () => { state.sort[key] = { col: i, rev: sort.col === i && !sort.rev }; route(); },
  }, label + (sort.col === i ? (sort.rev ? " ▼" : " ▲") : ""))));
  const body = sorted.map((row) => el("tr", {}, columns.map(([, get, num, render]) =>
    el("td", { class: num ? "num" : "" }, render ? render(row) : get(row)))));
  return el("table", { id }, el("thead", {}, head), el("tbody", {}, body));
}

// A line chart of server-side samples (/api/leveret/samples: every 5 s, the last 10 minutes), with a
// time axis, so the history survives a reload and every tab shows the same.
function drawChart(canvas, samples, series, unit) {
  const ctx = canvas.getContext("2d");
  const w = (canvas.width = canvas.clientWidth || 600), h = (canvas.height = canvas.clientHeight || 160);
  const left = 64, bottom = 18, top = 14, right = 8;
  const max = Math.max(1e-9, ...samples.flatMap((p) => series.map(([k]) => p[k] || 0)));
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px sans-serif"; ctx.fillStyle = "#555"; ctx.strokeStyle = "#ccc";
  // unit: "bytes", "bytes/s" (sizes in KiB, MiB...) or a word written after the top value.
  const sized = unit && unit.startsWith("bytes");
  const fmt = sized ? bytes : (v) => (Math.round(v * 10) / 10).toLocaleString();
  ctx.fillText(fmt(max) + (sized ? unit.slice(5) : unit ? " " + unit : ""), 2, top);
  ctx.fillText("0", 2, h - bottom);
  ctx.beginPath(); ctx.moveTo(left, top); ctx.lineTo(left, h - bottom); ctx.lineTo(w - right, h - bottom); ctx.stroke();
  if (!samples.length) { ctx.fillText("no samples yet", left + 8, h / 2); return; }
  const t0 = samples[0].timestamp, t1 = Math.max(t0 + 1, samples[samples.length - 1].timestamp);
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (w - left - right);
  const y = (v) => h - bottom - (v / max) * (h - bottom - top);
  const clock = (t) => new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
  [t0, (t0 + t1) / 2, t1].forEach((t, i) => ctx.fillText(clock(t),
    Math.min(w - ctx.measureText(clock(t)).width - 2, x(t) - (i ? 30 : 0)), h - 4));
  series.forEach(([k, color, label], i) => {
    ctx.strokeStyle = color; ctx.beginPath();
    samples.forEach((p, j) => (j ? ctx.lineTo(x(p.timestamp), y(p[k] || 0)) : ctx.moveTo(x(p.timestamp), y(p[k] || 0))));
    ctx.stroke(); ctx.fillStyle = color;
    ctx.fillText(label || k, left + 8 + i * Math.min(110, (w - left - right) / series.length), top);
  });
}

function chartCard(id, title, samples, series, unit) {
  const canvas = el("canvas", { id, "data-points": samples.length });
  return { card: el("div", { class: "card chart" }, el("h3", {}, title), canvas),
    draw: () => drawChart(canvas, samples, series, unit) };
}

// An admin form: fields are [name, label, kind, default] with kind text, password, number, checkbox,
// json (a JSON object, {} when empty) or an array of options (a select). submit gets the values.
function adminForm(id, title, fields, button, submit) {
  const inputs = fields.map(([name, label, kind, value]) => {
    let input;
    if (Array.isArray(kind)) input = el("select", { name }, kind.map((o) => el("option", { value: o }, o)));
    else if (kind === "checkbox") input = el("input", { name, type: "checkbox", ...(value ? { checked: "" } : {}) });
    else if (kind === "json") input = el("input", { name, value: value ?? "", placeholder: "{}", size: "24" });
    else input = el("input", { name, type: kind || "text", value: value ?? "" });
    return el("label", {}, label + " ", input);
  });
  return el("form", { class: "card inline admin", id, onsubmit: async (e) => {
    e.preventDefault();
    const values = {};
    for (const [name, label, kind] of fields) {
      const input = e.target.elements[name];
      if (kind === "checkbox") values[name] = input.checked;
      else if (kind === "number") values[name] = Number(input.value);
      else if (kind === "json") {
        try { values[name] = input.value.trim() ? JSON.parse(input.value) : {}; } catch (err) {
          return act(() => Promise.reject(new Error(`${label}: not JSON (${err.message})`)));
        }
      } else values[name] = input.value;
    }
    await act(() => submit(values), `${button}: done`);
  } }, el("h3", {}, title), inputs, el("button", {}, button));
}

// A list paged, sorted and filtered by the node (RabbitMQ's page, page_size, name, sort and columns
// parameters), so 10,000 objects never travel at once. cols: [label, field (dotted), numeric, render].
async function pagedList(key, path, noun, cols) {
  const q = (state.lists[key] ||= { page: 1, name: "", sort: "name", rev: false });
  const fields = cols.map(([, field]) => field.replace(/_details\.rate$/, "_details"));
  const params = new URLSearchParams({ page: String(q.page), page_size: "100", name: q.name, use_regex: "false",
    sort: q.sort, sort_reverse: String(q.rev), columns: [...new Set(["vhost", "name", ...fields])].join(",") });
  const res = await api("GET", `${path}?${params}`);
  if (q.page > 1 && q.page > res.page_count) { q.page = Math.max(1, res.page_count); return pagedList(key, path, noun, cols); }
  const get = (row, field) => field.split(".").reduce((o, k) => (o || {})[k], row) ?? "";
  const head = el("tr", {}, cols.map(([label, field, num]) => el("th", { class: num ? "num" : "", onclick: () => {
    q.rev = q.sort === field ? !q.rev : false; q.sort = field; q.page = 1; route();
  } }, label + (q.sort === field ? (q.rev ? " ▼" : " ▲") : ""))));
  const body = res.items.map((row) => el("tr", {}, cols.map(([, field, num, render]) =>
    el("td", { class: num ? "num" : "" }, render ? render(row) : String(get(row, field) ?? ""))))); 
  const filter = el("form", { class: "inline list-filter", id: `${key}-filter`, onsubmit: (e) => {
    e.preventDefault(); q.name = new FormData(e.target).get("name"); q.page = 1; route();
  } }, el("label", {}, "Name contains ", el("input", { name: "name", value: q.name })), el("button", {}, "Filter"));
  const pager = el("p", { id: `${key}-pager` },
    el("button", { id: `${key}-prev`, ...(res.page <= 1 ? { disabled: "" } : {}), onclick: () => { q.page -= 1; route(); } },
      "‹ Previous"),
    ` page ${res.page} of ${Math.max(1, res.page_count)} (${res.filtered_count} of ${res.total_count} ${noun}) `,
    el("button", { id: `${key}-next`, ...(res.page >= res.page_count ? { disabled: "" } : {}),
      onclick: () => { q.page += 1; route(); } }, "Next ›"));
  return { view: [el("h2", { id: `${key}-heading` }, `${noun[0].toUpperCase()}${noun.slice(1)} (${res.filtered_count})`),
    filter, pager, el("table", { id: key }, el("thead", {}, head), el("tbody", {}, body))], res };
}

const views = {
  async overview() {
    const [o, nodes, hist] = await Promise.all([api("GET", "/overview"), api("GET", "/nodes").catch(() => []),
      api("GET", "/leveret/samples").catch(() => ({ samples: [] }))]);
    const s = o.message_stats || {};
    const t = o.queue_totals, n = o.object_totals;
    const pts = hist.samples;
    const charts = [
      chartCard("queued-chart", "Queued messages", pts, [["messages", "#2b6cb0", "total"],
        ["messages_ready", "#2f855a", "ready"], ["messages_unacknowledged", "#c05621", "unacked"]], "msgs"),
      chartCard("rates-chart", "Message rates", pts, [["publish_rate", "#2b6cb0", "publish"],
        ["confirm_rate", "#6b46c1", "confirm"], ["deliver_rate", "#c05621", "deliver"],
        ["get_rate", "#b7791f", "get"], ["ack_rate", "#2f855a", "ack"], ["redeliver_rate", "#b00020", "redeliver"]],
      "msg/s"),
      chartCard("memory-chart", "Memory (the alarm's measure) against the alarm", pts,
        [["mem_used", "#2b6cb0", "used"], ["mem_limit", "#b00020", "alarm at"], ["mem_rss", "#999", "RSS"]], "bytes"),
      chartCard("disk-chart", "Disk free against the limit", pts,
        [["disk_free", "#2f855a", "free"], ["disk_free_limit", "#b00020", "limit"]], "bytes"),
      chartCard("fds-chart", "File descriptors and sockets", pts,
        [["fd_used", "#2b6cb0", "fds"], ["sockets_used", "#c05621", "sockets"]], ""),
    ];
    const view = [
      el("h2", {}, "Overview — ", o.node, " (", o.product_name, " ", o.product_version, ")"),
      el("div", { class: "card totals", id: "totals" },
        [["Queues", n.queues], ["Connections", n.connections], ["Channels", n.channels], ["Consumers", n.consumers],
         ["Messages", t.messages], ["Ready", t.messages_ready], ["Unacked", t.messages_unacknowledged],
         ["Publish/s", rate(s, "publish")], ["Deliver/s", rate(s, "deliver_get")]]
          .map(([k, v]) => el("div", {}, el("b", {}, v), k))),
      el("div", { class: "charts", id: "charts" }, charts.map((c) => c.card)),
      el("h3", {}, "Nodes"),
      table("nodes", [["Name", (x) => x.name], ["Memory held (the alarm's measure)", (x) => bytes(x.mem_used || 0), true],
        ["Alarm at", (x) => bytes(x.mem_limit || 0), true], ["RSS", (x) => bytes(x.mem_rss || 0), true],
        ["Memory alarm", (x) => String(x.mem_alarm)], ["Uptime (s)", (x) => Math.round(x.uptime / 1000), true]],
      nodes, "nodes"),
    ];
    return { view, after: () => charts.forEach((c) => c.draw()) };
  },

  async queues() {
    const { view } = await pagedList("queues", "/queues", "queues", [["Vhost", "vhost"], ["Name", "name", false,
      (row) => el("a", { href: `#/queue/${enc(row.vhost)}/${enc(row.name)}`, class: "queue-link" }, row.name)],
    ["Type", "type"], ["Messages", "messages", true], ["Ready", "messages_ready", true],
    ["Unacked", "messages_unacknowledged", true], ["Consumers", "consumers", true],
    ["Publish/s", "message_stats.publish_details.rate", true],
    ["Deliver/s", "message_stats.deliver_get_details.rate", true]]);
    const add = adminForm("add-queue", "Add a queue", [["vhost", "Vhost", "text", "/"], ["name", "Name"],
      ["type", "Type", ["classic", "quorum", "stream"]], ["durable", "Durable", "checkbox", true],
      ["auto_delete", "Auto-delete", "checkbox"], ["arguments", "Arguments", "json"]], "Add queue",
    (v) => api("PUT", `/queues/${enc(v.vhost)}/${enc(v.name)}`, { durable: v.durable, auto_delete: v.auto_delete,
      arguments: { ...v.arguments, "x-queue-type": v.type } }));
    return { view: [...view, add] };
  },

  async queue(vhost, name) {
    const path = `/queues/${enc(vhost)}/${enc(name)}`;
    const [q, bindings, consumers, hist] = await Promise.all([api("GET", path), api("GET", path + "/bindings"),
      api("GET", `/consumers/${enc(vhost)}`),
      api("GET", `/leveret/samples?vhost=${enc(vhost)}&queue=${enc(name)}`).catch(() => ({ samples: [] }))]);
    // The node keeps this queue's samples from the first time its page is shown (the last 10 minutes).
    const depth = chartCard("queue-depth-chart", "Queued messages", hist.samples, [["messages", "#2b6cb0", "total"],
      ["messages_ready", "#2f855a", "ready"], ["messages_unacknowledged", "#c05621", "unacked"]], "msgs");
    const rates = chartCard("queue-rates-chart", "Message rates", hist.samples, [["publish_rate", "#2b6cb0",
      "publish"], ["deliver_get_rate", "#c05621", "deliver/get"], ["ack_rate", "#2f855a", "ack"],
      ["redeliver_rate", "#b00020", "redeliver"]], "msg/s");
    const out = el("pre", { id: "got" });
    const getForm = el("form", { class: "card inline", id: "get-form", onsubmit: async (e) => {
      e.preventDefault();
      const f = new FormData(e.target);
      try {
        const msgs = await api("POST", path + "/get", { count: Number(f.get("count")), ackmode: f.get("ackmode"),
          encoding: "auto" });
        out.textContent = msgs.length ? msgs.map((m) => `${m.routing_key}: ${m.payload}`).join("\n") : "Queue is empty";
      } catch (err) { out.textContent = "Error: " + err.message; }
    } },
    el("h3", {}, "Get messages"),
    el("label", {}, "Count ", el("input", { name: "count", value: "1", size: "4" })),
    el("label", {}, "Ack mode ", el("select", { name: "ackmode" },
      ["ack_requeue_true", "ack_requeue_false", "reject_requeue_true", "reject_requeue_false"]
        .map((m) => el("option", { value: m }, m)))),
    el("button", { id: "get-button" }, "Get messages"), out);
    const pubForm = el("form", { class: "card inline", id: "publish-form", onsubmit: async (e) => {
      e.preventDefault();
      const f = new FormData(e.target);
      let properties, headers;
      try {
        properties = f.get("properties").trim() ? JSON.parse(f.get("properties")) : {};
        headers = f.get("headers").trim() ? JSON.parse(f.get("headers")) : {};
      } catch (err) { return act(() => Promise.reject(new Error("properties and headers must be JSON objects"))); }
      await act(() => api("POST", `/exchanges/${enc(vhost)}/amq.default/publish`, { routing_key: name,
        payload: f.get("payload"), payload_encoding: "string",
        properties: { ...properties, delivery_mode: f.get("persistent") === "on" ? 2 : 1,
          ...(Object.keys(headers).length ? { headers } : {}) } }), "Message published");
    } },
    el("h3", {}, "Publish a message"),
    el("label", {}, "Payload ", el("input", { name: "payload", id: "payload" })),
    el("label", {}, "Persistent ", el("input", { name: "persistent", type: "checkbox" })),
    el("label", {}, "Properties ", el("input", { name: "properties", id: "pub-properties",
      placeholder: '{"content_type": "text/plain"}', size: "28" })),
    el("label", {}, "Headers ", el("input", { name: "headers", id: "pub-headers", placeholder: '{"k": "v"}',
      size: "20" })),
    el("button", { id: "publish-button" }, "Publish"));
    // RabbitMQ's "move messages": a dynamic shovel from this queue that deletes itself once it has
    // moved what the queue held when it started.
    const moveForm = adminForm("move-form", "Move messages", [["dest", "To queue"]], "Move messages",
      (v) => api("PUT", `/parameters/shovel/${enc(vhost)}/${enc("Move from " + name)}`, { value: {
        "src-uri": "amqp:///" + enc(vhost), "src-queue": name, "dest-uri": "amqp:///" + enc(vhost),
        "dest-queue": v.dest, "src-delete-after": "queue-length" } }));
    const mine = consumers.filter((c) => c.queue.name === name);
    return { view: [
      el("h2", { id: "queue-heading" }, `Queue ${name} (vhost ${vhost})`),
      el("div", { class: "card totals", id: "queue-totals" },
        [["Messages", q.messages, "q-messages"], ["Ready", q.messages_ready], ["Unacked", q.messages_unacknowledged],
         ["Consumers", q.consumers], ["Publish/s", rate(q.message_stats, "publish")],
         ["Deliver/s", rate(q.message_stats, "deliver_get")]]
          .map(([k, v, id]) => el("div", {}, el("b", { id }, v), k))),
      el("p", {}, `durable: ${q.durable}, auto-delete: ${q.auto_delete}, arguments: ${JSON.stringify(q.arguments)}`),
      el("div", { class: "charts", id: "queue-charts" }, depth.card, rates.card),
      el("div", {},
        el("button", { id: "purge-button", onclick: () => act(() => api("DELETE", path + "/contents"), "Purged") },
          "Purge"),
        el("button", { id: "delete-button", onclick: async () => {
          if (!confirm(`Delete queue ${name}?`)) return;
          await act(() => api("DELETE", path), "Deleted");
          location.hash = "#/queues";
        } }, "Delete")),
      el("h3", {}, "Bindings"),
      table("bindings", [["From", (b) => b.source || "(default exchange)"], ["Routing key", (b) => b.routing_key],
        ["Arguments", (b) => JSON.stringify(b.arguments)]], bindings, "qbindings"),
      el("h3", {}, "Consumers"),
      table("consumers", [["Tag", (c) => c.consumer_tag], ["Channel", (c) => c.channel_details.name],
        ["Ack required", (c) => String(c.ack_required)], ["Prefetch", (c) => c.prefetch_count, true]],
      mine, "qconsumers"),
      getForm, pubForm, moveForm,
    ], after: () => { depth.draw(); rates.draw(); } };
  },

  async exchanges() {
    const [{ view }, bs] = await Promise.all([pagedList("exchanges", "/exchanges", "exchanges", [
      ["Vhost", "vhost"], ["Name", "name", false, (x) => x.name || "(default)"], ["Type", "type"],
      ["Durable", "durable"], ["Arguments", "arguments", false, (x) => JSON.stringify(x.arguments || {})],
      ["Publish in/s", "message_stats.publish_in_details.rate", true]]), api("GET", "/bindings")]);
    return { view: [...view,
    el("h3", {}, "Bindings"), table("all-bindings", [["Vhost", (b) => b.vhost], ["Source", (b) => b.source || "(default)"],
      ["Destination", (b) => `${b.destination_type} ${b.destination}`], ["Routing key", (b) => b.routing_key],
      ["Arguments", (b) => JSON.stringify(b.arguments)]], bs.filter((b) => b.source), "all-bindings"),
    adminForm("add-exchange", "Add an exchange", [["vhost", "Vhost", "text", "/"], ["name", "Name"],
      ["type", "Type", ["direct", "fanout", "topic", "headers", "x-consistent-hash"]],
      ["durable", "Durable", "checkbox", true], ["auto_delete", "Auto-delete", "checkbox"],
      ["internal", "Internal", "checkbox"], ["arguments", "Arguments", "json"]], "Add exchange",
    (v) => api("PUT", `/exchanges/${enc(v.vhost)}/${enc(v.name)}`, { type: v.type, durable: v.durable,
      auto_delete: v.auto_delete, internal: v.internal, arguments: v.arguments })),
    adminForm("delete-exchange", "Delete an exchange", [["vhost", "Vhost", "text", "/"], ["name", "Name"]],
      "Delete exchange", (v) => api("DELETE", `/exchanges/${enc(v.vhost)}/${enc(v.name)}`)),
    adminForm("add-binding", "Add a binding", [["vhost", "Vhost", "text", "/"], ["source", "From exchange"],
      ["kind", "To", ["queue", "exchange"]], ["destination", "Destination"], ["routing_key", "Routing key"],
      ["arguments", "Arguments", "json"]], "Bind",
    (v) => api("POST", `/bindings/${enc(v.vhost)}/e/${enc(v.source)}/${v.kind === "queue" ? "q" : "e"}/` +
      enc(v.destination), { routing_key: v.routing_key, arguments: v.arguments }))] };
  },

  async connections() {
    return pagedList("connections", "/connections", "connections", [
      ["Name", "name", false, (c) => el("a", { href: `#/connection/${enc(c.name)}`, class: "connection-link" }, c.name)],
      ["Protocol", "protocol"], ["User", "user"], ["Vhost", "vhost"], ["State", "state"],
      ["Channels", "channels", true],
      // An MQTT connection's client id, as RabbitMQ's MQTT plugin puts it in client_properties.
      ["Client", "client_properties", false, (c) => {
        const p = c.client_properties || {};
        return p.client_id !== undefined ? `${p.product || ""} ${p.client_id}`.trim() : p.product || "";
      }],
      ["Received/s", "recv_oct_details.rate", true], ["Sent/s", "send_oct_details.rate", true],
      ["", "peer_port", false, (c) => el("button", { class: "close-connection", onclick: async () => {
        const reason = prompt(`Close ${c.name}? Reason:`, "Closed via the Leveret console");
        if (reason === null) return;
        await act(() => api("DELETE", `/connections/${enc(c.name)}`, undefined, { "X-Reason": reason }), "Closed");
      } }, "Close")],
    ]);
  },

  async connection(name) {
    const path = `/connections/${enc(name)}`;
    const [c, chans, hist] = await Promise.all([api("GET", path), api("GET", path + "/channels").catch(() => []),
      api("GET", `/leveret/samples?connection=${enc(name)}`).catch(() => ({ samples: [] }))]);
    // The node keeps this connection's samples from the first time its page is shown (the last 10 minutes);
    // its message rates are its channels' summed.
    const octets = chartCard("connection-octets-chart", "Data rates", hist.samples,
      [["recv_oct_rate", "#2b6cb0", "received"], ["send_oct_rate", "#c05621", "sent"]], "bytes/s");
    const msgs = chartCard("connection-rates-chart", "Message rates", hist.samples, [["publish_rate", "#2b6cb0",
      "publish"], ["confirm_rate", "#6b46c1", "confirm"], ["deliver_get_rate", "#c05621", "deliver/get"],
      ["ack_rate", "#2f855a", "ack"], ["redeliver_rate", "#b00020", "redeliver"]], "msg/s");
    const client = c.client_properties || {};
    return { view: [
      el("h2", { id: "connection-heading" }, `Connection ${name}`),
      el("div", { class: "card totals", id: "connection-totals" },
        [["User", c.user], ["Vhost", c.vhost], ["State", c.state], ["Channels", c.channels],
         ["Received/s", bytes(rate(c, "recv_oct")) + "/s"], ["Sent/s", bytes(rate(c, "send_oct")) + "/s"],
         ["Received", bytes(c.recv_oct)], ["Sent", bytes(c.send_oct)]]
          .map(([k, v]) => el("div", {}, el("b", {}, v), k))),
      el("p", {}, `client: ${client.product || "?"} ${client.version || ""}, protocol: ${c.protocol}, ` +
        `heartbeat: ${c.timeout} s, frame max: ${c.frame_max}`),
      el("div", { class: "charts", id: "connection-charts" }, octets.card, msgs.card),
      el("h3", {}, "Channels"),
      table("connection-channels", [["Channel", (ch) => ch.number, true], ["Consumers", (ch) => ch.consumer_count, true],
        ["Unacked", (ch) => ch.messages_unacknowledged, true], ["Prefetch", (ch) => ch.prefetch_count, true],
        ["Confirm", (ch) => String(ch.confirm)], ["Publish/s", (ch) => rate(ch.message_stats, "publish"), true],
        ["Deliver/s", (ch) => rate(ch.message_stats, "deliver_get"), true]], chans, "connection-channels"),
    ], after: () => { octets.draw(); msgs.draw(); } };
  },

  async channels() {
    return pagedList("channels", "/channels", "channels", [["Name", "name"], ["User", "user"],
      ["Consumers", "consumer_count", true], ["Unacked", "messages_unacknowledged", true],
      ["Prefetch", "prefetch_count", true], ["Confirm", "confirm"],
      ["Publish/s", "message_stats.publish_details.rate", true],
      ["Deliver/s", "message_stats.deliver_get_details.rate", true]]);
  },

  async users() {
    const [users, perms] = await Promise.all([api("GET", "/users"), api("GET", "/permissions")]);
    return { view: [el("h2", {}, "Users"), table("users", [["Name", (u) => u.name], ["Tags", (u) => u.tags.join(", ")]],
      users, "users"), el("h3", {}, "Permissions"), table("permissions", [["User", (p) => p.user],
      ["Vhost", (p) => p.vhost], ["Configure", (p) => p.configure], ["Write", (p) => p.write],
      ["Read", (p) => p.read]], perms, "permissions"),
    adminForm("add-user", "Add or update a user", [["name", "Name"], ["password", "Password", "password"],
      ["tags", "Tags", "text", "management"]], "Save user",
    (v) => api("PUT", `/users/${enc(v.name)}`, { password: v.password, tags: v.tags })),
    adminForm("delete-user", "Delete a user", [["name", "Name"]], "Delete user",
      (v) => api("DELETE", `/users/${enc(v.name)}`)),
    adminForm("add-vhost", "Add a vhost", [["name", "Name"], ["description", "Description"]], "Add vhost",
      (v) => api("PUT", `/vhosts/${enc(v.name)}`, { description: v.description })),
    adminForm("delete-vhost", "Delete a vhost", [["name", "Name"]], "Delete vhost",
      (v) => api("DELETE", `/vhosts/${enc(v.name)}`)),
    adminForm("set-permissions", "Set permissions", [["vhost", "Vhost", "text", "/"], ["user", "User"],
      ["configure", "Configure", "text", ".*"], ["write", "Write", "text", ".*"], ["read", "Read", "text", ".*"]],
    "Set permissions", (v) => api("PUT", `/permissions/${enc(v.vhost)}/${enc(v.user)}`,
      { configure: v.configure, write: v.write, read: v.read })),
    adminForm("set-topic-permissions", "Set topic permissions", [["vhost", "Vhost", "text", "/"], ["user", "User"],
      ["exchange", "Exchange", "text", "amq.topic"], ["write", "Write", "text", ".*"], ["read", "Read", "text", ".*"]],
    "Set topic permissions", (v) => api("PUT", `/topic-permissions/${enc(v.vhost)}/${enc(v.user)}`,
      { exchange: v.exchange, write: v.write, read: v.read })),
    adminForm("set-limit", "Set a vhost limit", [["vhost", "Vhost", "text", "/"],
      ["name", "Limit", ["max-connections", "max-queues"]], ["value", "Value", "number", "100"]], "Set limit",
    (v) => api("PUT", `/vhost-limits/${enc(v.vhost)}/${enc(v.name)}`, { value: v.value }))] };
  },

  async retention() {
    // The last scheduled retention run of this node (leveret/retention_schedule.py): table and chart.
    const { report, chart } = await api("GET", "/leveret/retention");
    if (!report) return { view: [el("h2", {}, "Retention"), el("p", { id: "no-retention" },
      "No retention run has finished on this node yet (see docs/RETENTION.md: retention_schedule).")] };
    const t = report.totals || {};
    const view = [el("h2", {}, "Retention"),
      el("p", { id: "retention-summary" }, `Run ${report.run_id}${report.dry_run ? " (dry run)" : ""}: ` +
        `removed ${t.removed_messages} of ${t.messages_before} messages (${bytes(t.removed_bytes)}), ` +
        `archived ${t.archived_messages}, kept ${t.kept_messages}.`),
      table("retention", [["Queue", (q) => (q.vhost === "/" ? "" : q.vhost + "/") + q.queue],
        ["Before", (q) => q.messages_before, true], ["Removed", (q) => q.removed_messages, true],
        ["Removed bytes", (q) => q.removed_bytes, true, (q) => bytes(q.removed_bytes)],
        ["Archived", (q) => q.archived_messages, true], ["Kept", (q) => q.kept_messages, true],
        ["Kept bytes", (q) => q.kept_bytes, true, (q) => bytes(q.kept_bytes)],
        ["Oldest kept (s)", (q) => Math.round(q.oldest_age_seconds || 0), true]], report.queues || [], "retention")];
    let after;
    if (chart) {
      const img = el("img", { id: "retention-chart", alt: "retention report chart" });
      view.push(img);
      after = async () => {
        // An <img src> cannot send the Authorization header: fetch it, then show the blob.
        const res = await fetch("/api/leveret/retention/chart.png", { headers: { Authorization: "Basic " + state.auth,
          "X-Requested-With": "XMLHttpRequest" } });
        if (res.ok) img.src = URL.createObjectURL(await res.blob());
      };
    }
    return { view, after };
  },

  async policies() {
    const [ps, ops] = await Promise.all([api("GET", "/policies"), api("GET", "/operator-policies").catch(() => [])]);
    const cols = [["Vhost", (p) => p.vhost], ["Name", (p) => p.name],
      ["Pattern", (p) => p.pattern], ["Apply to", (p) => p["apply-to"]],
      ["Definition", (p) => JSON.stringify(p.definition)], ["Priority", (p) => p.priority, true]];
    const kind = (v) => (v.operator ? "operator-policies" : "policies");
    return { view: [el("h2", {}, "Policies"), table("policies", cols, ps, "policies"),
      el("h3", {}, "Operator policies"), table("operator-policies", cols, ops, "operator-policies"),
      adminForm("add-policy", "Add or update a policy", [["vhost", "Vhost", "text", "/"], ["name", "Name"],
        ["pattern", "Pattern", "text", ".*"], ["apply", "Apply to", ["all", "queues", "exchanges"]],
        ["priority", "Priority", "number", "0"], ["definition", "Definition", "json"],
        ["operator", "Operator policy", "checkbox"]], "Save policy",
      (v) => api("PUT", `/${kind(v)}/${enc(v.vhost)}/${enc(v.name)}`, { pattern: v.pattern, "apply-to": v.apply,
        priority: v.priority, definition: v.definition })),
      adminForm("delete-policy", "Delete a policy", [["vhost", "Vhost", "text", "/"], ["name", "Name"],
        ["operator", "Operator policy", "checkbox"]], "Delete policy",
      (v) => api("DELETE", `/${kind(v)}/${enc(v.vhost)}/${enc(v.name)}`))] };
  },

  async shovels() {
    const ss = await api("GET", "/shovels");
    return { view: [el("h2", {}, "Shovels"), table("shovels", [["Vhost", (s) => s.vhost], ["Name", (s) => s.name],
      ["State", (s) => s.state], ["Node", (s) => s.node], ["Source", (s) => `${s.src_uri || ""} ${s.src_queue ||
      s.src_exchange || ""}`], ["Destination", (s) => `${s.dest_uri || ""} ${s.dest_queue || s.dest_exchange || ""}`],
      ["Moved", (s) => s.messages_shovelled ?? "", true], ["Last error", (s) => s.reason || ""]], ss, "shovels")] };
  },

  async federation() {
    const ls = await api("GET", "/federation-links");
    return { view: [el("h2", {}, "Federation links"), table("federation", [["Vhost", (l) => l.vhost],
      ["Exchange", (l) => l.exchange], ["Upstream", (l) => l.upstream], ["URI", (l) => l.uri],
      ["Upstream exchange", (l) => l.upstream_exchange], ["Status", (l) => l.status], ["Node", (l) => l.node],
      ["Forwarded", (l) => l.messages_forwarded ?? "", true], ["Error", (l) => l.error || ""]], ls, "federation")] };
  },
};

async function act(fn, done) {
  const status = document.getElementById("status") || el("p", { id: "status" });
  try { await fn(); status.className = "ok"; status.textContent = done; }
  catch (err) { status.className = "error"; status.textContent = "Error: " + err.message; }
  main().prepend(status);
  await route(true);
}

// refresh: the same page again (the 5 s timer, after an action); a navigation passes nothing.
async function route(refresh) {
  clearTimeout(state.timer);
  const gen = ++state.gen;
  const key = location.hash;
  const parts = key.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  const name = views[parts[0]] ? parts[0] : "overview";
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.hash === "#/" + name));
  const status = refresh ? document.getElementById("status") : null;
  try {
    const { view, after } = await views[name](...parts.slice(1));
    // Another route() started meanwhile (the user went elsewhere): this answer is for a page no longer wanted.
    if (gen !== state.gen) return;
    const swaps = refresh && state.shown === key
      ? view.filter((v) => v.id && v.tagName !== "FORM" && document.getElementById(v.id)) : [];
    if (swaps.length) {
      // The same page, refreshed: its forms stay as they are (a half-typed message, the focus) and its
      // numbers and tables are swapped. Another page (address bar, back/forward, a link) is drawn anew.
      swaps.forEach((v) => document.getElementById(v.id).replaceWith(v));
    } else {
      main().replaceChildren(...(status ? [status] : []), ...view);
      state.shown = key;
    }
    if (after) after();
  } catch (err) {
    if (gen !== state.gen) return;
    state.shown = null;
    if (err.message !== "401") main().replaceChildren(el("p", { class: "error" }, "Error: " + err.message));
  }
  state.timer = setTimeout(() => route(true), 5000);
}

async function start() {
  const form = document.getElementById("login");
  const error = sessionStorage.getItem("leveret-login-error");
  if (error) { document.getElementById("login-error").textContent = error; sessionStorage.removeItem("leveret-login-error"); }
  if (!state.auth) {
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      const f = new FormData(form);
      const auth = btoa(unescape(encodeURIComponent(`${f.get("username")}:${f.get("password")}`)));
      const res = await fetch("/api/whoami", { headers: { Authorization: "Basic " + auth,
        "X-Requested-With": "XMLHttpRequest" } });
      if (!res.ok) { document.getElementById("login-error").textContent = "Login failed"; return; }
      sessionStorage.setItem("leveret-auth", auth);
      state.auth = auth;
      start();
    });
    return;
  }
  const me = await api("GET", "/whoami");
  document.getElementById("who").textContent = `${me.name} (${me.tags.join(", ")}) `;
  document.getElementById("who").append(el("a", { href: "#", id: "logout", onclick: (e) => { e.preventDefault(); logout(); } },
    "log out"));
  document.getElementById("nav").hidden = false;
  window.addEventListener("hashchange", () => route());
  route();
}

start();
