// Shared by both pages: an element builder, a POST helper and a live feed over server-sent events.
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const c of children.flat()) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

async function post(path, data) {
  const res = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(data) });
  const body = await res.json();
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function when(seconds) {
  return new Date(seconds * 1000).toLocaleTimeString();
}

// Each event is one item; items already shown (by id) are skipped, so a reconnect that
// replays the history does not duplicate them. The newest item goes on top.
function live(listId, render) {
  const list = document.getElementById(listId);
  const seen = new Set();
  const source = new EventSource("/events");
  source.onmessage = (ev) => {
    const item = JSON.parse(ev.data);
    if (seen.has(item.id)) return;
    seen.add(item.id);
    list.querySelector(".empty")?.remove();
    list.prepend(render(item));
  };
  source.onopen = () => document.body.dataset.live = "yes";
  return source;
}

function say(id, text, error) {
  const s = document.getElementById(id);
  s.textContent = text;
  s.className = "status" + (error ? " error" : "");
}
