"use strict";
// The dashboard's model: step records (from the live stream or a trace file) become compact per-step
// arrays, from which any window of the slot timeline is drawn at once; the block map and the request rows
// at the current step are kept by applying each step's changes in order (the same code for live and replay).

const EV_FINISH = 1, EV_PREEMPT = 2, EV_CACHED = 3, EV_KV = 4, EV_DRAFTS = 5;
const MARK_PREEMPT = 0, MARK_DRAFTS = 1;  // what a timeline mark shows: a preemption, or a step that carried drafts
const NO_SLOT = 0xffff;

class Grow {
  // A typed array that doubles when full: millions of entries without millions of JS objects.
  constructor(Type, capacity = 4096) { this.Type = Type; this.a = new Type(capacity); this.n = 0; }
  push(value) {
    if (this.n === this.a.length) { const b = new this.Type(this.a.length * 2); b.set(this.a); this.a = b; }
    this.a[this.n++] = value;
  }
  dropFront(k) { this.a.copyWithin(0, k, this.n); this.n -= k; }
}

class StepStore {
  // One entry per step: queue sizes, KV use, tokens, the slot holders (request, slot, tokens computed),
  // and the step's events (finished, preempted, cached, block-table changes) for the state at any step.
  constructor(numSlots) {
    this.numSlots = numSlots;
    this.ids = []; this.index = new Map();
    for (const name of ["step", "waiting", "running", "swapped", "tokens", "holdOff", "evOff"]) this[name] = new Grow(Int32Array);
    this.start = new Grow(Float64Array); this.end = new Grow(Float64Array); this.kv = new Grow(Float32Array);
    this.holdReq = new Grow(Int32Array); this.holdPos = new Grow(Uint16Array); this.holdTok = new Grow(Uint16Array);
    this.ev = new Grow(Int32Array);
    // Marks on the timeline: preemptions, and requests' steps that carried speculative drafts.
    this.markStep = new Grow(Int32Array); this.markPos = new Grow(Uint16Array); this.markKind = new Grow(Uint8Array);
    this.holdOff.push(0); this.evOff.push(0);
    this.slotOf = new Map(); this.slotFree = new Uint8Array(numSlots).fill(1);
    this.dropped = 0;  // steps removed from the front (a long live session keeps the latest only)
  }
  get length() { return this.step.n; }
  intern(id) {
    let i = this.index.get(id);
    if (i === undefined) { i = this.ids.length; this.ids.push(id); this.index.set(id, i); }
    return i;
  }
  lastStep() { return this.step.n ? this.step.a[this.step.n - 1] : -1; }

  push(rec) {
    const k = this.step.n;
    this.step.push(rec.step); this.start.push(rec.start); this.end.push(rec.end);
    this.waiting.push(rec.num_waiting); this.running.push(rec.num_running); this.swapped.push(rec.num_swapped || 0);
    this.kv.push(rec.kv_usage);
    let tokens = 0;
    for (const id in rec.scheduled) tokens += rec.scheduled[id];
    this.tokens.push(tokens);
    for (const id of rec.preempted || []) {
      const slot = this.slotOf.get(this.intern(id));
      if (slot !== undefined) this.mark(k, slot, MARK_PREEMPT);
    }
    this.assignSlots(rec);
    for (const id in rec.drafts || {}) {
      const slot = this.slotOf.get(this.intern(id));
      if (slot !== undefined && slot !== NO_SLOT) this.mark(k, slot, MARK_DRAFTS);
    }
    this.holdOff.push(this.holdReq.n);
    this.pushEvents(rec);
    this.evOff.push(this.ev.n);
  }

  mark(k, slot, kind) { this.markStep.push(k); this.markPos.push(slot); this.markKind.push(kind); }

  assignSlots(rec) {
    // As the seed's picture (Trace.slot_fill): a request keeps its slot while it holds one; newcomers take
    // the lowest free slot.
    const holding = new Set();
    for (const id of rec.slots) holding.add(this.intern(id));
    for (const [req, slot] of this.slotOf) {
      if (!holding.has(req)) { this.slotOf.delete(req); if (slot !== NO_SLOT) this.slotFree[slot] = 1; }
    }
    for (const req of holding) {
      let slot = this.slotOf.get(req);
      if (slot === undefined) {
        slot = this.slotFree.indexOf(1);
        if (slot < 0) slot = NO_SLOT; else this.slotFree[slot] = 0;
        this.slotOf.set(req, slot);
      }
      const tok = rec.scheduled[this.ids[req]] || 0;
      this.holdReq.push(req); this.holdPos.push(slot); this.holdTok.push(Math.min(tok, 0xffff));
    }
  }

  pushEvents(rec) {
    const ev = this.ev;
    for (const id of rec.preempted || []) { ev.push(EV_PREEMPT); ev.push(this.intern(id)); }
    for (const id in rec.cached || {}) { ev.push(EV_CACHED); ev.push(this.intern(id)); ev.push(rec.cached[id]); }
    const accepted = rec.accepted || {};
    for (const id in rec.drafts || {}) {
      ev.push(EV_DRAFTS); ev.push(this.intern(id)); ev.push(rec.drafts[id]); ev.push(accepted[id] || 0);
    }
    const changes = rec.kv_blocks || {};
    for (const id in changes) {
      const change = changes[id];
      ev.push(EV_KV); ev.push(this.intern(id)); ev.push(change[0]); ev.push(change.length - 1);
      for (let i = 1; i < change.length; i++) ev.push(change[i]);
    }
    for (const id of rec.finished || []) { ev.push(EV_FINISH); ev.push(this.intern(id)); }
  }

  dropFront(k) {
    // Forget the oldest k steps (live sessions): per-step arrays shift, offsets are rebased.
    const hold0 = this.holdOff.a[k], ev0 = this.evOff.a[k];
    for (const name of ["step", "waiting", "running", "swapped", "tokens", "start", "end", "kv"]) this[name].dropFront(k);
    this.holdOff.dropFront(k); this.evOff.dropFront(k);
    for (let i = 0; i < this.holdOff.n; i++) this.holdOff.a[i] -= hold0;
    for (let i = 0; i < this.evOff.n; i++) this.evOff.a[i] -= ev0;
    for (const g of [this.holdReq, this.holdPos, this.holdTok]) g.dropFront(hold0);
    this.ev.dropFront(ev0);
    let keep = 0;
    while (keep < this.markStep.n && this.markStep.a[keep] < k) keep++;
    this.markStep.dropFront(keep); this.markPos.dropFront(keep); this.markKind.dropFront(keep);
    for (let i = 0; i < this.markStep.n; i++) this.markStep.a[i] -= k;
    this.dropped += k;
  }
}

class BatchState {
  // The block map and (for replays) the request rows, as of one step: built by applying steps in order.
  constructor(store, numBlocks, numCpuBlocks, replay) {
    this.store = store; this.replay = replay;
    this.numBlocks = numBlocks; this.numCpuBlocks = numCpuBlocks;
    this.ref = new Uint16Array(numBlocks); this.owner = new Int32Array(numBlocks).fill(-1);
    this.evictable = new Uint8Array(numBlocks);
    this.tables = new Map();      // request index -> its block ids
    this.cpuTables = new Map();   // request id -> its blocks in the CPU swap pool (live only)
    this.rows = new Map();        // request id -> row
    this.applied = 0;             // steps of the store applied so far
  }

  setTable(req, start, blocks) {
    const old = this.tables.get(req) || [];
    for (let i = start; i < old.length; i++) this.release(old[i], req);
    for (const b of blocks) this.take(b, req);
    const table = old.slice(0, start).concat(blocks);
    if (table.length) this.tables.set(req, table); else this.tables.delete(req);
  }
  take(b, req) {
    if (b >= this.numBlocks) return;
    if (this.ref[b]++ === 0) this.owner[b] = req;
    this.evictable[b] = 0;
  }
  release(b, req) {
    if (b >= this.numBlocks || this.ref[b] === 0) return;
    this.ref[b]--;
    if (this.ref[b] === 0) this.owner[b] = -1;
    else if (this.owner[b] === req) this.owner[b] = -2;  // still shared by others
  }

  applyUpTo(k, applyKv = true) {
    // Apply steps [applied, k) of the store.
    const s = this.store;
    for (let i = this.applied; i < k; i++) {
      if (this.replay) this.applyHolders(i);
      this.applyEvents(i, applyKv);
    }
    this.applied = Math.max(this.applied, k);
  }

  applyHolders(i) {
    const s = this.store;
    for (let h = s.holdOff.a[i]; h < s.holdOff.a[i + 1]; h++) {
      const tok = s.holdTok.a[h];
      const row = this.replayRow(s.holdReq.a[h], i);
      row.status = tok ? "running" : "held";
      row.computed += tok; row.lastStep = s.step.a[i];
    }
  }

  replayRow(req, i) {
    const id = this.store.ids[req];
    let row = this.rows.get(id);
    if (!row) {
      row = { status: "running", prompt: null, output: null, computed: 0, remaining: null, priority: null,
              preemptions: 0, cached: 0, drafted: 0, accepted: 0, ttft: null, firstStep: this.store.step.a[i],
              order: req };
      this.rows.set(id, row);
    }
    return row;
  }

  applyEvents(i, applyKv) {
    const s = this.store, ev = s.ev.a;
    let e = s.evOff.a[i];
    const end = s.evOff.a[i + 1];
    while (e < end) {
      const type = ev[e], req = ev[e + 1];
      if (type === EV_KV) {
        const start = ev[e + 2], count = ev[e + 3];
        if (applyKv) this.setTable(req, start, Array.from(ev.subarray(e + 4, e + 4 + count)));
        e += 4 + count;
        continue;
      }
      const values = type === EV_CACHED ? 1 : type === EV_DRAFTS ? 2 : 0;
      if (this.replay) this.replayEvent(type, req, values ? ev[e + 2] : 0, i, values > 1 ? ev[e + 3] : 0);
      e += 2 + values;
    }
  }

  replayEvent(type, req, value, i, value2) {
    const id = this.store.ids[req];
    if (type === EV_FINISH) { this.rows.delete(id); return; }
    const row = this.replayRow(req, i);
    if (type === EV_PREEMPT) { row.preemptions++; row.status = "preempted"; }
    if (type === EV_CACHED) row.cached = value;
    if (type === EV_DRAFTS) { row.drafted += value; row.accepted += value2; }
  }

  blocksOf(id) {
    const req = this.store.index.get(id);
    return req === undefined ? [] : (this.tables.get(req) || []);
  }
  blockState(b) {
    if (this.ref[b] > 1) return "shared";
    if (this.ref[b] === 1) return "held";
    return this.evictable[b] ? "evictable" : "free";
  }
  heldBlocks() { let n = 0; for (let b = 0; b < this.numBlocks; b++) n += this.ref[b] > 0; return n; }
}

class LiveSession {
  // The live stream's deltas, applied to a store and a state (see conveyor/observe/live.py for their shape).
  constructor() { this.store = null; this.state = null; this.stats = null; this.window = null; this.updates = 0;
                  this.metricsHistory = []; this.config = null; }

  apply(delta) {
    if (delta.keyframe) this.reset(delta);
    const store = this.store, state = this.state;
    // A keyframe's tables hold every step up to tables_step: its history is drawn without replaying their
    // table changes, then the tables are set, then any later steps (merged deltas) apply on top.
    const tablesStep = delta.keyframe ? delta.tables_step : -Infinity;
    let tablesSet = !delta.keyframe;
    for (const rec of delta.steps) {
      if (!tablesSet && rec.step > tablesStep) { this.setTables(delta.tables); tablesSet = true; }
      if (rec.step <= store.lastStep()) continue;  // already shown
      store.push(rec);
      state.applyUpTo(store.length, rec.step > tablesStep);
    }
    if (!tablesSet) this.setTables(delta.tables);
    for (const id of delta.kv_released) state.setTable(store.intern(id), 0, []);  // left between steps
    for (const id of delta.removed) { state.rows.delete(id); state.cpuTables.delete(id); }
    for (const id in delta.requests) {
      const row = delta.requests[id];
      state.rows.set(id, row);
      if (row.status !== "swapped") state.cpuTables.delete(id);
    }
    for (const id in delta.cpu_blocks) state.cpuTables.set(id, delta.cpu_blocks[id]);
    for (const b of delta.evictable) if (b < state.numBlocks && state.ref[b] === 0) state.evictable[b] = 1;
    this.stats = delta.stats; this.window = delta.window; this.updates++;
    this.metricsHistory.push({ time: delta.time, ...delta.window });
    if (this.metricsHistory.length > 600) this.metricsHistory.splice(0, 300);
    if (store.length > 60000) { store.dropFront(30000); state.applied = store.length; }
  }

  setTables(tables) {
    for (const id in tables) this.state.setTable(this.store.intern(id), 0, tables[id].slice(1));
  }

  reset(keyframe) {
    const c = this.config = keyframe.config;
    this.store = new StepStore(c.max_num_seqs);
    this.state = new BatchState(this.store, c.num_kv_blocks, c.num_cpu_blocks || 0, false);
  }
}

async function loadTrace(stream, onProgress) {
  // A trace file (header line, then one step per line), parsed in pieces that yield to the browser between
  // them, so a trace of hundreds of MB loads without freezing the page.
  const reader = stream.getReader(), decoder = new TextDecoder();
  let rest = "", config = null, store = null, bytes = 0, lastYield = performance.now();
  const takeLine = (line) => {
    if (!line.trim()) return;
    const rec = JSON.parse(line);
    if (config === null) {
      if (!rec.config) throw new Error("not a Conveyor trace: the first line has no config");
      config = rec.config; store = new StepStore(config.max_num_seqs);
    } else {
      store.push(rec);
    }
  };
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    bytes += value.length;
    const text = rest + decoder.decode(value, { stream: true });
    const lines = text.split("\n");
    rest = lines.pop();
    for (const line of lines) {
      takeLine(line);
      if (performance.now() - lastYield > 25) {
        onProgress(bytes, store ? store.length : 0);
        await new Promise((resolve) => setTimeout(resolve, 0));
        lastYield = performance.now();
      }
    }
  }
  takeLine(rest + decoder.decode());
  if (config === null) throw new Error("empty trace file");
  return { config, store, bytes };
}
