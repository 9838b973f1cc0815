// The dashboard's view: canvases drawn from the model at most once a frame, the request table a few times a
// second, and the controls (live stream, or replay of a trace file with play, step and speed).

const $ = (id) => document.getElementById(id);
const TIMELINE_STEPS = 300;
// Live, the page redraws once a second (?fps=N for up to 10): the server may send ten updates a second, and
// where the browser shares the engine's cores each redraw's CPU is the engine's loss (about 25 ms of it in a
// headless Chromium on 2 cores: an always-running frame loop with 4 redraws a second cost the engine 6.8% of
// its throughput, frames on demand at 1 a second 1.8%).
const LIVE_FPS = Math.min(10, Math.max(0.1, Number(new URLSearchParams(location.search).get("fps")) || 1));
const LIVE_FRAME_MS = 1000 / LIVE_FPS, LIVE_TABLE_MS = Math.max(LIVE_FRAME_MS, 1000);
const PALETTE = Array.from({ length: 256 }, (_, i) => hslToRgb((i * 137.508) % 360, 0.62, 0.5));
const FREE = [255, 255, 255], EVICTABLE = [203, 213, 224], GAP = [232, 235, 240], SHARED_UNKNOWN = [74, 85, 104];
const SELECTED = [246, 224, 94], PREEMPT = [229, 62, 62], DRAFTS_SHADE = 0.55;

function hslToRgb(h, s, l) {
  const k = (n) => (n + h / 30) % 12, a = s * Math.min(l, 1 - l);
  const f = (n) => Math.round(255 * (l - a * Math.max(-1, Math.min(k(n) - 3, 9 - k(n), 1))));
  return [f(0), f(8), f(4)];
}
const colour = (req) => PALETTE[req % PALETTE.length];
const pale = (c, amount) => c.map((v) => Math.round(v + (255 - v) * amount));
const cssColour = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;

const ui = {
  mode: "live", session: null, replay: null, store: null, state: null,
  playhead: 0, playing: false, speed: 60, selected: null, sortKey: "order", sortUp: true,
  dirty: true, lastTable: 0, loadMs: null, maxStallMs: 0, error: null,
};

function view() {
  // What the canvases show: the live session's, or the replay's store and state at the playhead.
  if (ui.mode === "live") return ui.session && ui.session.store ? ui.session : null;
  return ui.replay;
}

// ----- drawing -------------------------------------------------------------------------------

function drawTimeline(store, endIndex) {
  const canvas = $("timeline"), numSlots = store.numSlots;
  const rowHeight = Math.max(1, Math.min(24, Math.floor(300 / numSlots)));
  sizeCanvas(canvas, Math.max(60, numSlots * rowHeight));
  // The latest TIMELINE_STEPS steps; a shorter run is stretched over the width instead of drawn in a corner.
  const cols = Math.min(TIMELINE_STEPS, Math.max(endIndex, 1)), start = Math.max(0, endIndex - cols);
  const image = new ImageData(cols, numSlots), px = image.data;
  px.fill(255);
  const selected = ui.selected === null ? undefined : store.index.get(ui.selected);
  for (let k = start; k < endIndex; k++) {
    const x = k - start;
    for (let h = store.holdOff.a[k]; h < store.holdOff.a[k + 1]; h++) {
      const slot = store.holdPos.a[h];
      if (slot === NO_SLOT) continue;
      const req = store.holdReq.a[h];
      let c = colour(req);
      if (!store.holdTok.a[h]) c = pale(c, 0.7);
      if (selected !== undefined && req !== selected) c = pale(c, 0.8);
      const o = (slot * cols + x) * 4;
      px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2];
    }
  }
  for (let m = 0; m < store.markStep.n; m++) {
    const k = store.markStep.a[m];
    if (k < start || k >= endIndex) continue;
    const o = (store.markPos.a[m] * cols + (k - start)) * 4;
    if (store.markKind.a[m] === MARK_DRAFTS) {  // the request's own colour, darker: it carried drafts
      px[o] *= DRAFTS_SHADE; px[o + 1] *= DRAFTS_SHADE; px[o + 2] *= DRAFTS_SHADE;
      continue;
    }
    px[o] = PREEMPT[0]; px[o + 1] = PREEMPT[1]; px[o + 2] = PREEMPT[2];
  }
  blit(canvas, image);
  if (endIndex) {
    const ctx = canvas.getContext("2d");
    ctx.font = "11px system-ui"; ctx.fillStyle = "rgba(29,36,48,.75)";
    ctx.fillText(`step ${store.step.a[start]}`, 4, canvas.height - 4);
    const last = `step ${store.step.a[endIndex - 1]}`;
    ctx.fillText(last, canvas.width * Math.min(1, (endIndex - start) / cols) - ctx.measureText(last).width - 4,
                 canvas.height - 4);
  }
}

function sizeCanvas(canvas, height) {
  // Setting a canvas's size, even to the same value, drops and reallocates its pixels: only when it changes.
  if (canvas.height !== height) canvas.height = height;
}

function blit(canvas, image) {
  const off = document.createElement("canvas");
  off.width = image.width; off.height = image.height;
  off.getContext("2d").putImageData(image, 0, 0);
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.drawImage(off, 0, 0, canvas.width, canvas.height);
}

function drawBlocks(state) {
  const canvas = $("blocks"), n = state.numBlocks;
  const cols = Math.ceil(Math.sqrt(n * 1.6)), cell = Math.max(1, Math.floor(canvas.width / cols));
  const rows = Math.ceil(n / cols);
  sizeCanvas(canvas, rows * cell);
  const width = cols * cell, image = new ImageData(width, rows * cell), px = image.data;
  const gap = cell >= 4 ? 1 : 0;
  const selected = ui.selected === null ? null : new Set(state.blocksOf(ui.selected));
  for (let b = 0; b < n; b++) {
    const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
    const owner = state.owner[b];
    let c = owner >= 0 ? colour(owner) : owner === -2 ? SHARED_UNKNOWN : state.evictable[b] ? EVICTABLE : FREE;
    if (selected && selected.size) c = selected.has(b) ? SELECTED : owner === -1 ? c : pale(c, 0.75);
    const dot = state.ref[b] > 1 && cell >= 4;
    for (let y = 0; y < cell; y++) {
      for (let x = 0; x < cell; x++) {
        const edge = gap && (x === cell - 1 || y === cell - 1);
        const centre = dot && Math.abs(x - (cell - 2) / 2) < cell / 5 && Math.abs(y - (cell - 2) / 2) < cell / 5;
        const p = edge ? GAP : centre ? FREE : c;
        const o = ((y0 + y) * width + x0 + x) * 4;
        px[o] = p[0]; px[o + 1] = p[1]; px[o + 2] = p[2]; px[o + 3] = 255;
      }
    }
  }
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.putImageData(image, 0, 0);
  const held = state.heldBlocks();
  $("blocks-caption").textContent = `${n.toLocaleString()} blocks, ${held.toLocaleString()} held`;
  drawCpuBlocks(state);
}

function drawCpuBlocks(state) {
  const canvas = $("cpu-blocks"), n = state.numCpuBlocks;
  $("cpu-title").hidden = canvas.hidden = !(n > 0 && ui.mode === "live");
  if (canvas.hidden) return;
  const owner = new Int32Array(n).fill(-1);
  for (const [id, blocks] of state.cpuTables) for (const b of blocks) if (b < n) owner[b] = ui.session.store.intern(id);
  const cols = Math.ceil(Math.sqrt(n * 9)), cell = Math.max(1, Math.floor(canvas.width / cols));
  sizeCanvas(canvas, Math.ceil(n / cols) * cell);
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  for (let b = 0; b < n; b++) {
    if (owner[b] < 0) continue;
    ctx.fillStyle = cssColour(colour(owner[b]));
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, Math.max(1, cell - 1), Math.max(1, cell - 1));
  }
}

function drawQueues(store, endIndex) {
  const canvas = $("queues"), ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  if (!endIndex) return;
  const points = Math.min(w, endIndex), pick = (x) => Math.floor((x / points) * endIndex);
  let top = 1;
  for (let x = 0; x < points; x++) {
    const k = pick(x);
    top = Math.max(top, store.running.a[k], store.waiting.a[k], store.swapped.a[k]);
  }
  const series = [["running", "#2b6cb0"], ["waiting", "#d69e2e"], ["swapped", "#9f7aea"]];
  for (const [name, stroke] of series) {
    ctx.beginPath(); ctx.strokeStyle = stroke; ctx.lineWidth = 1.5;
    for (let x = 0; x < points; x++) {
      const y = h - 2 - ((h - 14) * store[name].a[pick(x)]) / top;
      const px = (x / Math.max(1, points - 1)) * (w - 1);
      if (x) ctx.lineTo(px, y); else ctx.moveTo(px, y);
    }
    ctx.stroke();
  }
  ctx.fillStyle = "#667085"; ctx.font = "11px system-ui";
  ctx.fillText(`max ${top}`, 4, 11);
}

function drawSpark(id, values, format) {
  const canvas = $(id), ctx = canvas.getContext("2d"), w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const shown = values.filter((v) => v !== null && Number.isFinite(v));
  if (shown.length < 2) return;
  const top = Math.max(...shown) || 1;
  ctx.beginPath(); ctx.strokeStyle = "#2b6cb0"; ctx.lineWidth = 1.5;
  values.forEach((v, i) => {
    const x = (i / (values.length - 1)) * (w - 1), y = h - 2 - ((h - 6) * (v || 0)) / top;
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function drawSparklines(v) {
  const fmt = (x, digits = 1) => (x === null || x === undefined || !Number.isFinite(x) ? "–" : x.toFixed(digits));
  if (ui.mode === "live") {
    const history = v.metricsHistory.slice(-120), last = history[history.length - 1] || {};
    drawSpark("spark-throughput", history.map((m) => m.output_tokens_per_s));
    drawSpark("spark-computed", history.map((m) => m.total_tokens_per_s));
    drawSpark("spark-ttft", history.map((m) => m.ttft_p99_s));
    drawSpark("spark-tpot", history.map((m) => m.tpot_p99_s));
    $("value-throughput").textContent = fmt(last.output_tokens_per_s);
    $("value-computed").textContent = fmt(last.total_tokens_per_s);
    $("value-ttft").textContent = `${fmt(last.ttft_p50_s, 2)} / ${fmt(last.ttft_p99_s, 2)}`;
    $("value-tpot").textContent = `${fmt(last.tpot_p50_s, 3)} / ${fmt(last.tpot_p99_s, 3)}`;
    return;
  }
  const store = v.store, end = ui.playhead, start = Math.max(0, end - 120), rates = [];
  for (let k = start; k < end; k++) rates.push(store.tokens.a[k] / Math.max(1e-9, store.end.a[k] - store.start.a[k]));
  drawSpark("spark-computed", rates);
  $("value-computed").textContent = fmt(rates[rates.length - 1]);
  for (const id of ["value-throughput", "value-ttft", "value-tpot"]) $(id).textContent = "– (live only)";
}

// ----- counters and the request table ----------------------------------------------------------

function updateCounters(v) {
  const store = v.store, k = (ui.mode === "live" ? store.length : ui.playhead) - 1;
  const stats = ui.mode === "live" ? v.stats : null;
  const at = (g) => (k >= 0 ? store[g].a[k] : 0);
  $("count-step").textContent = stats ? stats.step : k >= 0 ? store.step.a[k] : 0;
  $("count-running").textContent = stats ? stats.num_running : at("running");
  $("count-waiting").textContent = stats ? stats.num_waiting : at("waiting");
  $("count-swapped").textContent = stats ? stats.num_swapped : at("swapped");
  $("count-kv").textContent = `${Math.round(100 * (stats ? stats.kv_usage : k >= 0 ? store.kv.a[k] : 0))}%`;
  const tput = ui.mode === "live" && v.window ? v.window.output_tokens_per_s.toFixed(1) : "–";
  $("count-throughput").textContent = tput;
  document.body.dataset.updates = ui.mode === "live" ? v.updates : ui.playhead;
}

function sortedRows(state) {
  const key = ui.sortKey, sign = ui.sortUp ? 1 : -1;
  const rows = Array.from(state.rows, ([id, row]) => ({ id, ...row, blocks: state.blocksOf(id).length }));
  rows.sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return a.id < b.id ? -1 : 1;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * sign;
  });
  return rows;
}

function drafts(row) {
  // Speculative decoding: drafts accepted of those carried, so far.
  return row.drafted ? `${row.accepted}/${row.drafted}` : "";
}

function renderTable(v) {
  const rows = sortedRows(v.state), shown = rows.slice(0, 300), store = v.store;
  const cell = (x, digits) => (x === null || x === undefined ? "" : digits ? x.toFixed(digits) : x);
  const html = shown.map((r) => {
    const req = store.index.get(r.id), dot = req === undefined ? "#ccc" : cssColour(colour(req));
    const cls = r.id === ui.selected ? ' class="selected"' : "";
    return `<tr data-id="${escapeHtml(r.id)}"${cls}><td><span class="dot" style="background:${dot}"></span>` +
      `${escapeHtml(r.id)}</td><td>${r.status}</td><td>${cell(r.prompt)}</td><td>${cell(r.output)}</td>` +
      `<td>${cell(r.computed)}</td><td>${cell(r.remaining)}</td><td>${cell(r.priority)}</td>` +
      `<td>${cell(r.preemptions)}</td><td>${cell(r.cached)}</td><td>${drafts(r)}</td><td>${r.blocks}</td>` +
      `<td>${cell(r.ttft, 2)}</td></tr>`;
  }).join("");
  document.querySelector("#requests tbody").innerHTML = html;
  $("requests-caption").textContent = rows.length > shown.length
    ? `${rows.length} requests, the first ${shown.length} shown` : `${rows.length} requests`;
  for (const th of document.querySelectorAll("#requests th")) {
    th.classList.toggle("sorted", th.dataset.key === ui.sortKey);
    th.classList.toggle("up", th.dataset.key === ui.sortKey && ui.sortUp);
  }
  renderSelection(v);
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function renderSelection(v) {
  const box = $("selection"), id = ui.selected;
  if (id === null) { box.textContent = "Click a request to see its slots and blocks."; return; }
  const row = v.state.rows.get(id), blocks = v.state.blocksOf(id);
  if (!row) { box.innerHTML = `<b>${escapeHtml(id)}</b> has left the engine.`; return; }
  const shared = blocks.filter((b) => v.state.ref[b] > 1).length;
  let text = `<b>${escapeHtml(id)}</b>: ${row.status}, ${blocks.length} KV blocks (${shared} shared)`;
  if (row.text) text += `; prompt: “${escapeHtml(row.text)}”`;
  if (row.status === "waiting" || row.status === "preempted") text += `. Waiting because ${waitReason(v, id, row)}.`;
  box.innerHTML = text;
}

function waitReason(v, id, row) {
  // The admission rules of conveyor/core/scheduler/continuous.py, read from the snapshot.
  if (ui.mode !== "live" || !v.stats) return "the trace does not say";
  const c = v.config, stats = v.stats, byPriority = c.scheduling_policy === "priority";
  const key = (r) => (byPriority ? [r.priority, r.order] : [0, r.order]);
  const mine = key(row);
  let ahead = 0;
  for (const other of v.state.rows.values()) {
    if (other.status !== "waiting" && other.status !== "preempted") continue;
    const k = key(other);
    if (k[0] < mine[0] || (k[0] === mine[0] && k[1] < mine[1])) ahead++;
  }
  if (stats.num_running >= c.max_num_seqs) return `the batch is full (max_num_seqs = ${c.max_num_seqs})`;
  if (stats.num_swapped) return "swapped requests are resumed first";
  if (ahead) return `${ahead} request${ahead > 1 ? "s" : ""} ahead of it in the queue`;
  const need = Math.ceil((row.prompt + row.output - row.cached) / c.block_size);
  if (need > stats.num_free_kv_blocks) return `the KV cache is short: it needs ${need} blocks, ${stats.num_free_kv_blocks} are free`;
  return "this step's token budget was spent; it joins at the next step";
}

// ----- the frame loop --------------------------------------------------------------------------

// Frames run only while there is something to show: a page left open on a quiet server, or a paused replay,
// costs no frames at all (an always-running frame loop was about half of the page's CPU while serving).
let looping = false;

function wake() {
  if (!looping) { looping = true; requestAnimationFrame(render); }
}

function markDirty() {
  ui.dirty = true;
  wake();
}

function render(now) {
  const v = view();
  if (ui.mode === "replay" && ui.playing && v) advanceReplay(now);
  const wait = v ? draw(v, now) : 0;
  if (ui.playing) requestAnimationFrame(render);
  else if (wait > 0) setTimeout(() => requestAnimationFrame(render), wait);
  else looping = false;
}

function draw(v, now) {
  // Draws the view if it changed; returns how many ms until a live redraw that is not yet due may run.
  if (!ui.dirty) return 0;
  const live = ui.mode === "live";
  const due = (ui.lastDraw || 0) + LIVE_FRAME_MS;
  if (live && now < due) return due - now;
  ui.dirty = false;
  ui.lastDraw = now;
  ui.draws = (ui.draws || 0) + 1;
  const began = performance.now();
  const end = live ? v.store.length : ui.playhead;
  drawTimeline(v.store, end);
  drawBlocks(v.state);
  drawQueues(v.store, end);
  drawSparklines(v);
  updateCounters(v);
  if (now - ui.lastTable > (live ? LIVE_TABLE_MS : 250)) { ui.lastTable = now; renderTable(v); } else ui.tablePending = true;
  ui.lastRenderMs = performance.now() - began;
  ui.maxRenderMs = Math.max(ui.maxRenderMs || 0, ui.lastRenderMs);
  if (!live) {
    $("replay-position").textContent = `step ${ui.playhead} of ${v.store.length}`;
    $("scrub").max = v.store.length; $("scrub").value = ui.playhead;
  }
  return 0;
}

// Anything that changed the view without calling markDirty (a control, a finished load) is drawn within 250 ms.
setInterval(() => { if (ui.dirty || ui.playing) wake(); }, 250);
setInterval(() => { if (ui.tablePending && view()) { ui.tablePending = false; renderTable(view()); } }, 300);
