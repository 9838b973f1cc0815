// The dashboard's controls: the live stream (server-sent events read with fetch, so the API key can go in a
// header), replay of a trace file (from the server, a file picker, or a file dropped on the page), the
// request table's sorting and selection, and a small read-only handle for tests (window.conveyorDashboard).

const params = new URLSearchParams(location.search);
const apiKey = params.get("api_key");
const watchedModel = params.get("model");  // several models: which one to follow (the server's first by default)

function setStatus(text, badge, badgeClass) {
  $("status").textContent = text;
  if (badge) { $("mode").textContent = badge; $("mode").className = `badge ${badgeClass || ""}`; }
}

async function followLive() {
  ui.mode = "live"; ui.session = new LiveSession();
  const headers = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  for (;;) {
    try {
      const query = watchedModel ? `?model=${encodeURIComponent(watchedModel)}` : "";
      const response = await fetch(`/debug/stream${query}`, { headers, cache: "no-store" });
      if (response.status === 401) { setStatus("the API key is missing or wrong: add ?api_key=KEY to the address", "no access", "down"); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      setStatus("", "live", "live");
      await readEvents(response.body, (delta) => {
        if (delta.model) $("model-name").textContent = delta.model;  // sent where a server has several models
        ui.session.apply(delta); markDirty();
      });
    } catch (error) {
      ui.error = String(error);
    }
    if (ui.mode !== "live") return;
    setStatus("disconnected; retrying", "offline", "down");
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

async function openTrace(stream, name) {
  ui.mode = "replay"; ui.playing = false; $("replay-bar").hidden = false;
  setStatus(`loading ${name}`, "replay", "replay");
  const began = performance.now();
  try {
    const { config, store, bytes } = await loadTrace(stream, (read, steps) => {
      setStatus(`loading ${name}: ${(read / 1e6).toFixed(0)} MB, ${steps.toLocaleString()} steps`);
    });
    ui.loadMs = performance.now() - began;
    ui.replay = { config, store, state: null };
    seek(0);
    ui.playing = true; ui.lastAdvance = null; wake();
    setStatus(`${name}: ${store.length.toLocaleString()} steps, ${(bytes / 1e6).toFixed(1)} MB, loaded in ${(ui.loadMs / 1000).toFixed(1)} s`);
  } catch (error) {
    ui.error = String(error);
    setStatus(`cannot replay ${name}: ${error.message}`, "replay", "down");
  }
  $("play").textContent = ui.playing ? "Pause" : "Play";
}

function seek(target) {
  const r = ui.replay;
  target = Math.max(0, Math.min(r.store.length, Math.round(target)));
  if (!r.state || target < r.state.applied) {
    r.state = new BatchState(r.store, r.config.num_kv_blocks || 1, 0, true);
  }
  r.state.applyUpTo(target);
  ui.playhead = target; markDirty();
}

function advanceReplay(now) {
  if (ui.lastAdvance == null) { ui.lastAdvance = now; ui.carry = 0; return; }
  const steps = ((now - ui.lastAdvance) / 1000) * ui.speed + ui.carry;
  ui.lastAdvance = now;
  const whole = Math.floor(steps);
  ui.carry = steps - whole;
  if (!whole) return;
  seek(ui.playhead + whole);
  if (ui.playhead >= ui.replay.store.length) { ui.playing = false; $("play").textContent = "Play"; }
}

function wireControls() {
  $("play").onclick = () => {
    if (!ui.replay) return;
    if (!ui.playing && ui.playhead >= ui.replay.store.length) seek(0);
    ui.playing = !ui.playing; ui.lastAdvance = null; wake();
    $("play").textContent = ui.playing ? "Pause" : "Play";
  };
  $("step-forward").onclick = () => { if (ui.replay) { ui.playing = false; $("play").textContent = "Play"; seek(ui.playhead + 1); } };
  $("step-back").onclick = () => { if (ui.replay) { ui.playing = false; $("play").textContent = "Play"; seek(ui.playhead - 1); } };
  $("speed").onchange = (e) => { ui.speed = Number(e.target.value); };
  $("scrub").oninput = (e) => { if (ui.replay) seek(Number(e.target.value)); };
  $("trace-input").onchange = (e) => { const f = e.target.files[0]; if (f) openTrace(f.stream(), f.name); };
  document.querySelector("#requests thead").onclick = (e) => {
    const key = e.target.dataset && e.target.dataset.key;
    if (!key) return;
    ui.sortUp = ui.sortKey === key ? !ui.sortUp : true;
    ui.sortKey = key; markDirty(); ui.lastTable = 0;
  };
  document.querySelector("#requests tbody").onclick = (e) => {
    const tr = e.target.closest("tr");
    if (!tr) return;
    ui.selected = ui.selected === tr.dataset.id ? null : tr.dataset.id;
    markDirty(); ui.lastTable = 0;
  };
  wireDrop();
}

function wireDrop() {
  let depth = 0;
  document.addEventListener("dragenter", (e) => { e.preventDefault(); depth++; $("drop-veil").hidden = false; });
  document.addEventListener("dragleave", () => { if (--depth <= 0) { depth = 0; $("drop-veil").hidden = true; } });
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("drop", (e) => {
    e.preventDefault(); depth = 0; $("drop-veil").hidden = true;
    const file = e.dataTransfer.files[0];
    if (file) openTrace(file.stream(), file.name);
  });
}

function watchStalls() {
  // The longest gap between timer ticks: how long the page could not answer (reported by the load check).
  let last = performance.now();
  setInterval(() => { const now = performance.now(); ui.maxStallMs = Math.max(ui.maxStallMs, now - last - 50); last = now; }, 50);
}

window.conveyorDashboard = {
  mode: () => ui.mode,
  updates: () => (ui.mode === "live" && ui.session ? ui.session.updates : 0),
  draws: () => ui.draws || 0,
  stepCount: () => (view() ? view().store.length : 0),
  playhead: () => ui.playhead,
  timelineRequestIds: () => {
    // The requests in the timeline's latest column.
    const v = view();
    if (!v || !v.store.length) return [];
    const s = v.store, k = (ui.mode === "live" ? s.length : ui.playhead) - 1;
    if (k < 0) return [];
    const ids = [];
    for (let h = s.holdOff.a[k]; h < s.holdOff.a[k + 1]; h++) ids.push(s.ids[s.holdReq.a[h]]);
    return ids;
  },
  blocksOf: (id) => (view() ? view().state.blocksOf(id) : []),
  blockState: (b) => view().state.blockState(b),
  heldBlocks: () => (view() ? view().state.heldBlocks() : 0),
  loadMs: () => ui.loadMs,
  maxStallMs: () => ui.maxStallMs,
  maxRenderMs: () => ui.maxRenderMs || 0,
  error: () => ui.error,
  seek: (k) => seek(k),
  pause: () => { ui.playing = false; },
};

wireControls();
watchStalls();
wake();
const traceUrl = document.querySelector('meta[name="conveyor-trace"]').content;
if (traceUrl) {
  fetch(traceUrl).then((r) => openTrace(r.body, document.querySelector('meta[name="conveyor-trace-name"]').content));
} else {
  followLive();
}
