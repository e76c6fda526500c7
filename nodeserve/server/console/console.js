// nodeserve console: reads the live feed (GET /debug/events, Server-Sent Events read through fetch() so that an
// API key can go in the Authorization header, never in a URL) and draws it; the chat box streams from
// /v1/chat/completions. Every value reaches the page through textContent or a canvas, never as HTML.
"use strict";

const WINDOW_S = 30;          // the timeline's span, as the server's history
const RATE_S = 5;             // per-lane rates over the last few seconds
const STALE_S = 5;            // no message for this long: reconnect
const KEY_STORE = "nodeserve-console-key";
const COLORS = {prefill: "#e8871e", decode: "#3f7cc0", mixed: "#9a5fb5", transfer: "#3f9b57",
                rolePrefill: "#d2473f", roleAdaptive: "#9aa3ad", roleDecode: "#3f7cc0", marker: "#f5a623"};

const $ = (id) => document.getElementById(id);

// An element with attributes and children; strings become text nodes (never parsed as HTML).
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") e.className = v; else e.setAttribute(k, String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

function fmt(x, digits = 1) { return x === null || x === undefined ? "-" : Number(x).toFixed(digits); }
function ms(s) { return s === null || s === undefined ? "-" : (s < 10 ? Math.round(s * 1000) + " ms" : s.toFixed(1) + " s"); }
function mb(bytes) { return (bytes / 1e6).toFixed(1) + " MB"; }

// ---- the API key ----------------------------------------------------------------------------------------
const auth = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  headers(extra) {
    const h = Object.assign({}, extra || {});
    if (this.key) h["Authorization"] = "Bearer " + this.key;
    return h;
  },
  ask(message) {
    $("key-form").hidden = false;
    $("key-error").textContent = message || "";
    $("key-input").focus();
  },
};

function setupKey() {
  $("key-button").addEventListener("click", () => { $("key-form").hidden = !$("key-form").hidden; });
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    auth.key = $("key-input").value.trim();
    $("key-input").value = "";
    if (auth.key) sessionStorage.setItem(KEY_STORE, auth.key); else sessionStorage.removeItem(KEY_STORE);
    $("key-form").hidden = true;
    feed.restart();
  });
  $("key-forget").addEventListener("click", () => {
    auth.key = "";
    sessionStorage.removeItem(KEY_STORE);
    $("key-error").textContent = "forgotten";
  });
}

// ---- Server-Sent Events over fetch() --------------------------------------------------------------------
// Calls onData(text) for every `data:` payload of a text/event-stream response body.
async function readSSE(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buf += decoder.decode(value, {stream: true});
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) onData(data);
    }
  }
}

// ---- the feed -------------------------------------------------------------------------------------------
const feed = {
  ctrl: null, lastAt: 0, backoff: 1000, lastSeq: 0, dropped: 0, waitingForKey: false,
  start() {
    this.connect();
    setInterval(() => {  // a feed that went quiet (a proxy holding it, a stalled server): start again
      if (this.ctrl && this.lastAt && performance.now() - this.lastAt > STALE_S * 1000) this.restart();
    }, 1000);
  },
  restart() {
    this.waitingForKey = false;
    if (this.ctrl) this.ctrl.abort();
    this.ctrl = null;
    this.backoff = 1000;
    this.connect();
  },
  async connect() {
    if (this.ctrl) return;
    const ctrl = this.ctrl = new AbortController();
    setConn("connecting", "warn");
    try {
      const resp = await fetch("/debug/events", {headers: auth.headers(), cache: "no-store", signal: ctrl.signal});
      if (resp.status === 401) {
        this.ctrl = null;
        this.waitingForKey = true;
        setConn("needs the API key", "off");
        auth.ask(auth.key ? "That key was refused." : "");
        return;
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      this.lastAt = performance.now();
      this.backoff = 1000;
      this.lastSeq = 0;
      await readSSE(resp, (text) => this.message(JSON.parse(text)));
    } catch (err) {
      if (ctrl.signal.aborted) return;
    }
    if (this.ctrl !== ctrl) return;
    this.ctrl = null;
    setConn("reconnecting", "off");
    setTimeout(() => this.connect(), this.backoff);
    this.backoff = Math.min(this.backoff * 2, 5000);
  },
  message(msg) {
    this.lastAt = performance.now();
    if (this.lastSeq && msg.seq > this.lastSeq + 1) this.dropped += msg.seq - this.lastSeq - 1;
    this.lastSeq = msg.seq;
    setConn(this.dropped ? "live (" + this.dropped + " updates dropped)" : "live", "ok");
    view.update(msg);
  },
};

function setConn(text, cls) {
  const c = $("conn");
  c.textContent = "feed: " + text;
  c.className = "pill " + cls;
  document.body.dataset.feed = cls === "ok" ? "live" : "down";
}

// ---- the view -------------------------------------------------------------------------------------------
const view = {
  now: 0, receivedAt: 0, lanes: new Map(), transfers: new Map(), maxSeqs: 64, model: null,

  update(msg) {
    this.now = msg.now;
    this.receivedAt = performance.now();
    this.model = msg.model || null;
    $("model").textContent = msg.model || "";
    $("mode").textContent = msg.mode ? msg.mode + " mode" : "";
    const st = $("status");
    st.textContent = msg.status;
    st.className = "pill " + (msg.status === "ready" ? "ok" : msg.status === "loading" ? "warn" : "off");
    if (msg.cost_ms !== undefined) $("cost").textContent = "feed " + fmt(msg.cost_ms, 2) + " ms/update";
    if (!msg.devices) return;  // loading
    this.maxSeqs = msg.max_num_seqs || this.maxSeqs;
    for (const d of msg.devices) this.lane(d, msg);
    for (const c of msg.role_changes || []) this.roleChange(c, msg.history);
    for (const t of msg.transfers || []) this.transfer(t, msg);
    const running = msg.devices.reduce((a, d) => a + d.running, 0);
    const waiting = msg.devices.reduce((a, d) => a + d.waiting, 0) + (msg.pending || 0);
    $("node-summary").textContent = running + " running, " + waiting + " waiting" +
      (msg.pending ? " (" + msg.pending + " queued for pages)" : "") + this.migrations(msg.migrations);
    this.tiers(msg.tiers || []);
    requests.render(msg.requests);
    slo.render(msg);
    this.draw();
  },

  lane(d, msg) {
    let lane = this.lanes.get(d.name);
    if (!lane) {
      const canvas = el("canvas", {height: 44, "aria-label": "step timeline of " + d.name});
      const used = el("div", {class: "used"}), cached = el("div", {class: "cached"});
      const node = el("div", {class: "lane", "data-device": d.name},
        el("div", {class: "lane-head"},
          el("span", {class: "lane-name"}, d.name), el("span", {class: "role"}), el("span", {class: "role-note"}),
          el("span", {class: "counts meta small"}), el("span", {class: "rates meta small"})),
        canvas,
        el("div", {class: "kv"}, el("span", {}, "KV"), el("div", {class: "kvbar"}, used, cached),
          el("span", {class: "kvtext"})));
      $("lanes").append(node);
      lane = {node, canvas, used, cached, steps: [], lastEnd: -Infinity, role: d.role, changes: [],
              changedAt: null, numChanges: 0};
      this.lanes.set(d.name, lane);
    }
    if (msg.history) { lane.steps = []; lane.lastEnd = -Infinity; }
    for (const s of d.steps) if (s[1] > lane.lastEnd) { lane.steps.push(s); lane.lastEnd = s[1]; }
    const cut = msg.now - WINDOW_S;
    while (lane.steps.length && lane.steps[0][1] < cut) lane.steps.shift();
    if (d.role !== lane.role) this.markChange(lane, msg.now, d.role, null);
    lane.changes = lane.changes.filter((c) => c[0] >= cut);
    lane.role = d.role;
    const n = lane.node;
    n.dataset.role = d.role;
    n.dataset.steps = String(lane.steps.length);
    n.classList.toggle("dead", !!d.dead);
    const role = n.querySelector(".role");
    role.textContent = d.role + (d.dead ? " (dead)" : "");
    role.className = "role " + d.role;
    const changed = lane.changedAt !== null && msg.now - lane.changedAt < 15;
    n.classList.toggle("role-changed", changed);
    n.querySelector(".role-note").textContent = lane.changedAt === null ? "" :
      "changed " + fmt(Math.max(0, msg.now - lane.changedAt), 0) + " s ago" + (lane.reason ? " (" + lane.reason + ")" : "");
    n.querySelector(".counts").textContent = d.running + " running, " + d.waiting + " waiting";
    // Rates over the last RATE_S seconds of steps: decode tokens, prefill tokens, busy share.
    let dec = 0, pre = 0, busy = 0;
    const from = msg.now - RATE_S;
    for (const s of lane.steps) {
      if (s[1] < from) continue;
      dec += s[3]; pre += s[2]; busy += s[1] - Math.max(s[0], from);
    }
    n.querySelector(".rates").textContent = "decode " + fmt(dec / RATE_S, 0) + " tok/s, prefill " +
      fmt(pre / RATE_S, 0) + " tok/s, busy " + fmt(100 * busy / RATE_S, 0) + "%" +
      (d.spec && d.spec[0] ? ", guesses " + fmt(100 * d.spec[1] / d.spec[0], 0) + "% accepted" : "");
    n.dataset.specAccepted = d.spec && d.spec[0] ? String(d.spec[1] / d.spec[0]) : "";
    n.dataset.decodeRate = String(dec / RATE_S);
    const kv = d.kv, total = Math.max(kv.pages, 1);
    lane.used.style.width = (100 * kv.used / total).toFixed(1) + "%";
    lane.cached.style.width = (100 * Math.min(kv.cached, total) / total).toFixed(1) + "%";
    n.querySelector(".kvtext").textContent = kv.used + " used, " + kv.cached + " cached, " + kv.free + " free of " +
      kv.pages + " pages";
  },

  markChange(lane, time, role, reason) {
    if (lane.changes.some((c) => Math.abs(c[0] - time) < 1e-3 && c[1] === role)) return;
    lane.changes.push([time, role]);
    lane.changedAt = time;
    lane.reason = reason;
    lane.numChanges += 1;
    lane.node.dataset.roleChanges = String(lane.numChanges);
  },

  roleChange(c, history) {
    const [time, device, role, reason] = c;
    const lane = this.lanes.get(device);
    if (!lane) return;
    // A change the role field already showed (same role, within a tick) only gains its exact time and reason.
    const shown = lane.changes.find((x) => x[1] === role && Math.abs(x[0] - time) < 1.0);
    if (shown) { shown[0] = time; lane.changedAt = time; lane.reason = reason; return; }
    this.markChange(lane, time, role, reason);
  },

  transfer(t, msg) {
    let tr = this.transfers.get(t.name);
    if (!tr) {
      if ($("transfers").querySelector("p")) $("transfers").textContent = "";
      const canvas = el("canvas", {height: 16, "aria-label": "copies " + t.name});
      const node = el("div", {class: "xfer", "data-transfer": t.name},
        el("div", {class: "xfer-head"}, el("span", {}, t.src + " \u2192 " + t.dst), el("span", {class: "rate"})),
        canvas);
      $("transfers").append(node);
      tr = {node, canvas, copies: [], lastEnd: -Infinity, total: 0};
      this.transfers.set(t.name, tr);
    }
    if (msg.history) { tr.copies = []; tr.lastEnd = -Infinity; }
    for (const c of t.copies) if (c[1] > tr.lastEnd) { tr.copies.push(c); tr.lastEnd = c[1]; }
    const cut = msg.now - WINDOW_S;
    while (tr.copies.length && tr.copies[0][1] < cut) tr.copies.shift();
    const bytes30 = tr.copies.reduce((a, c) => a + c[2], 0);
    tr.node.querySelector(".rate").textContent = fmt(t.mb_s, 1) + " MB/s now, " + mb(bytes30) + " in 30 s";
    tr.node.dataset.copies = String(tr.copies.length);
  },

  tiers(tiers) {
    const parts = tiers.filter((t) => t.tier !== "device").map((t) =>
      t.tier + " tier: " + t.used + " of " + t.pages + " pages, " + t.hit_tokens + " prompt tokens served");
    const dev = tiers.find((t) => t.tier === "device");
    if (dev && dev.hit_tokens) parts.push("from other devices: " + dev.hit_tokens + " prompt tokens");
    $("tiers").textContent = parts.join(" \u00b7 ");
  },

  migrations(m) {
    const moved = (m || {}).moved || 0;
    return moved ? ", " + moved + " moved between devices" : "";
  },

  draw() {
    if (document.hidden) return;
    const now = this.now;
    for (const lane of this.lanes.values()) drawLane(lane.canvas, now, lane.steps, lane.changes, lane.role);
    for (const tr of this.transfers.values()) drawCopies(tr.canvas, now, tr.copies);
  },
};

function fitCanvas(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = Math.max(1, Math.round(canvas.clientWidth * dpr)), h = Math.max(1, Math.round(canvas.clientHeight * dpr));
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, canvas.clientWidth, canvas.clientHeight);
  return [ctx, canvas.clientWidth, canvas.clientHeight];
}

// One device's last WINDOW_S seconds: a role strip on top, then a bar per step (its kind's colour; a decode step's
// height grows with its batch), and a marker at each role change.
function drawLane(canvas, now, steps, changes, role) {
  const [ctx, W, H] = fitCanvas(canvas);
  const t0 = now - WINDOW_S, x = (t) => (t - t0) / WINDOW_S * W, strip = 5;
  // Role strip: the current role back to the last change, the one before it before that.
  const roleColor = (r) => r === "prefill" ? COLORS.rolePrefill : r === "decode" ? COLORS.roleDecode : COLORS.roleAdaptive;
  let right = W;
  let current = role;
  for (let i = changes.length - 1; i >= -1; i--) {
    const left = i >= 0 ? Math.max(0, x(changes[i][0])) : 0;
    ctx.fillStyle = roleColor(i >= 0 ? changes[i][1] : current);
    ctx.fillRect(left, 0, right - left, strip);
    if (i >= 0) current = changes[i][1] === "prefill" ? "adaptive" : "prefill";
    right = left;
    if (right <= 0) break;
  }
  for (const [s, e, p, d] of steps) {
    const kind = p > 0 && d > 0 ? "mixed" : p > 0 ? "prefill" : "decode";
    const frac = kind === "prefill" ? 1 : Math.min(1, 0.35 + 0.65 * d / Math.max(8, view.maxSeqs / 4));
    const h = (H - strip - 2) * frac;
    ctx.fillStyle = COLORS[kind];
    ctx.fillRect(x(s), H - h, Math.max(1, x(e) - x(s)), h);
  }
  ctx.strokeStyle = COLORS.marker;
  ctx.lineWidth = 2;
  for (const [t] of changes) {
    if (t < t0) continue;
    ctx.beginPath(); ctx.moveTo(x(t), 0); ctx.lineTo(x(t), H); ctx.stroke();
  }
}

function drawCopies(canvas, now, copies) {
  const [ctx, W, H] = fitCanvas(canvas);
  const t0 = now - WINDOW_S;
  ctx.fillStyle = COLORS.transfer;
  for (const [s, e] of copies) {
    const x0 = (s - t0) / WINDOW_S * W;
    ctx.fillRect(x0, 0, Math.max(1, (e - s) / WINDOW_S * W), H);
  }
}

// ---- requests -------------------------------------------------------------------------------------------
const requests = {
  render(r) {
    if (!r) return;
    const body = $("req-body");
    const rows = [];
    for (const q of r.in_flight) rows.push(this.row(q, false));
    for (const q of r.recent) rows.push(this.row(q, true));
    if (!rows.length) rows.push(el("tr", {}, el("td", {colspan: 10, class: "meta"}, "no requests yet")));
    body.replaceChildren(...rows);
    $("req-summary").textContent = r.num_in_flight + " in flight" +
      (r.num_in_flight > r.in_flight.length ? " (newest " + r.in_flight.length + " shown)" : "") +
      ", " + r.recent.length + " recent";
  },
  row(q, ended) {
    const devices = q.prefill && q.decode && q.prefill !== q.decode ? q.prefill + " \u2192 " + q.decode
      : (q.decode || q.prefill || "-");
    const from = Object.entries(q.from || {}).map(([k, v]) => k + " " + v).join(", ");
    const cached = q.cached ? q.cached + (from ? " (" + from + ")" : "") : "0";
    return el("tr", {class: ended ? "ended" : null, "data-request": q.id},
      el("td", {}, q.id), el("td", {}, el("span", {class: "state " + q.state}, q.state)), el("td", {}, devices),
      el("td", {class: "num"}, q.prompt), el("td", {class: "num opt"}, cached),
      el("td", {class: "num"}, q.out + "/" + q.max), el("td", {class: "num"}, ms(q.ttft)),
      el("td", {class: "num opt"}, ms(q.predicted)), el("td", {class: "num"}, fmt(q.tok_s, 1)),
      el("td", {class: "num opt"}, fmt(q.age, 0) + " s"));
  },
};

// ---- SLO and admission ----------------------------------------------------------------------------------
const slo = {
  render(msg) {
    const s = msg.slo;
    if (!s) return;
    const pct = (a, b) => b ? (100 * a / b).toFixed(1) + "%" : "-";
    $("slo-attain").textContent = pct(s.met, s.requests);
    $("slo-detail").textContent = s.requests ? s.met + " of " + s.requests + " requests met both targets over the last " +
      fmt(s.window_s / 60, 1) + " min (TTFT " + pct(s.met_ttft, s.requests) + ", TPOT " + pct(s.met_tpot, s.requests) + ")"
      : "no finished requests seen since this console opened";
    const targetTtft = s.ttft_s + (s.ttft_per_token_s ? " s + " + s.ttft_per_token_s + " s/token" : " s");
    $("slo-targets").textContent = "targets: TTFT \u2264 " + targetTtft + ", TPOT \u2264 " + Math.round(s.tpot_s * 1000) +
      " ms; admission: " + s.admission + (s.admission === "off" ? " (predicted, never refused)" : " (refuses predicted misses)");
    const bars = s.minutes.map(([n, met], i) => {
      const b = el("div", {class: "bar" + (n ? (met / n < 0.9 ? " low" : "") : " none"),
                          title: (5 - i) + " min ago: " + (n ? met + " of " + n : "no requests")});
      b.style.height = (n ? Math.max(4, 48 * met / n) : 4) + "px";
      return b;
    });
    $("slo-minutes").replaceChildren(...bars);
    const chips = Object.entries(msg.rejections || {}).map(([reason, n]) =>
      el("span", {class: "chip" + (n ? " hot" : ""), "data-reason": reason}, reason + " " + n));
    $("rejections").replaceChildren(...chips);
    this.scatter(s.predicted || []);
  },
  scatter(points) {
    const canvas = $("pred-canvas");
    const [ctx, W, H] = fitCanvas(canvas);
    if (!points.length) {
      $("pred-summary").textContent = "no predictions yet (SLO admission predicts TTFT when the start-up profile ran)";
      return;
    }
    const top = Math.max(0.05, ...points.map((p) => Math.max(p[0], p[1]))) * 1.1, pad = 22;
    const sx = (v) => pad + v / top * (W - pad - 6), sy = (v) => H - pad - v / top * (H - pad - 6);
    ctx.strokeStyle = "#c9ced6"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(sx(0), sy(0)); ctx.lineTo(sx(top), sy(top)); ctx.stroke();
    ctx.fillStyle = "#65707d"; ctx.font = "10px system-ui, sans-serif";
    ctx.fillText("predicted \u2192", W - 70, H - 6);
    ctx.save(); ctx.translate(10, 70); ctx.rotate(-Math.PI / 2); ctx.fillText("actual \u2192", 0, 0); ctx.restore();
    ctx.fillText(ms(top), W - 40, sy(top) + 10);
    ctx.fillStyle = COLORS.decode;
    for (const [p, a] of points) ctx.fillRect(sx(p) - 2, sy(a) - 2, 4, 4);
    const err = points.reduce((acc, [p, a]) => acc + (a - p), 0) / points.length;
    $("pred-summary").textContent = points.length + " requests; actual minus predicted: mean " + ms(Math.abs(err)) +
      (err >= 0 ? " slower" : " faster") + " than predicted";
  },
};

// ---- the chat box ---------------------------------------------------------------------------------------
const chat = {
  messages: [], ctrl: null,
  setup() {
    $("chat-form").addEventListener("submit", (ev) => { ev.preventDefault(); this.send(); });
    $("chat-input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); this.send(); }
    });
    $("chat-stop").addEventListener("click", () => { if (this.ctrl) this.ctrl.abort(); });
    $("chat-clear").addEventListener("click", () => {
      this.messages = []; $("chat-log").textContent = ""; $("chat-timing").textContent = "";
      fitCanvas($("chat-gaps"));
    });
  },
  async send() {
    const text = $("chat-input").value.trim();
    if (!text || this.ctrl) return;
    $("chat-input").value = "";
    this.messages.push({role: "user", content: text});
    const log = $("chat-log");
    log.append(el("div", {class: "msg user"}, text));
    const out = el("div", {class: "msg assistant", "data-state": "streaming"});
    log.append(out);
    log.scrollTop = log.scrollHeight;
    const temperature = parseFloat($("chat-temp").value), maxTokens = parseInt($("chat-max").value, 10);
    const body = {messages: this.messages, stream: true, stream_options: {include_usage: true},
                  temperature: isFinite(temperature) ? temperature : 0.7, max_tokens: maxTokens > 0 ? maxTokens : 128};
    if (view.model) body.model = view.model;
    const ctrl = this.ctrl = new AbortController();
    $("chat-send").disabled = true; $("chat-stop").disabled = false;
    const start = performance.now(), times = [];
    let answer = "", usage = null, finish = null;
    try {
      const resp = await fetch("/v1/chat/completions", {method: "POST", signal: ctrl.signal,
        headers: auth.headers({"Content-Type": "application/json"}), body: JSON.stringify(body)});
      if (resp.status === 401) { auth.ask("The chat needs the API key."); throw new Error("401: the API key is missing or wrong"); }
      if (!resp.ok) {
        let m = "HTTP " + resp.status;
        try { m += ": " + (await resp.json()).error.message; } catch (e) { /* not JSON */ }
        throw new Error(m);
      }
      await readSSE(resp, (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          if (c.finish_reason) finish = c.finish_reason;
          const piece = c.delta && c.delta.content;
          if (!piece) continue;
          const t = performance.now();
          const gap = times.length ? t - times[times.length - 1] : t - start;
          times.push(t);
          answer += piece;
          const span = el("span", {class: "tok" + (times.length === 1 ? " first" : ""),
                                   title: (times.length === 1 ? "first token after " : "+") + Math.round(gap) + " ms"}, piece);
          out.append(span);
          this.timing(start, times, usage, finish);
          log.scrollTop = log.scrollHeight;
        }
      });
      this.messages.push({role: "assistant", content: answer});
      out.dataset.state = "done";
    } catch (err) {
      out.dataset.state = "error";
      out.append(el("span", {class: "error"}, ctrl.signal.aborted ? " [stopped]" : " [" + err.message + "]"));
      if (answer) this.messages.push({role: "assistant", content: answer});
      else this.messages.pop();
    } finally {
      this.ctrl = null;
      $("chat-send").disabled = false; $("chat-stop").disabled = true;
      this.timing(start, times, usage, finish);
      this.markSlow(out, times);
    }
  },
  gaps(times) { return times.slice(1).map((t, i) => t - times[i]); },
  timing(start, times, usage, finish) {
    if (!times.length) { $("chat-timing").textContent = ""; return; }
    const gaps = this.gaps(times), sorted = gaps.slice().sort((a, b) => a - b);
    const p50 = sorted.length ? sorted[Math.floor(sorted.length / 2)] : null;
    const span = (times[times.length - 1] - times[0]) / 1000;
    const parts = ["TTFT " + Math.round(times[0] - start) + " ms", times.length + " chunks"];
    if (usage) parts.push(usage.completion_tokens + " tokens (prompt " + usage.prompt_tokens + ")");
    if (span > 0) parts.push(fmt((times.length - 1) / span, 1) + " tok/s");
    if (p50 !== null) parts.push("gap p50 " + Math.round(p50) + " ms, max " + Math.round(sorted[sorted.length - 1]) + " ms");
    if (finish) parts.push("finish: " + finish);
    $("chat-timing").textContent = parts.join(" \u00b7 ");
    this.spark(gaps);
  },
  spark(gaps) {  // one bar per inter-token gap, the slow ones (over twice the median) in orange
    const [ctx, W, H] = fitCanvas($("chat-gaps"));
    if (!gaps.length) return;
    const sorted = gaps.slice().sort((a, b) => a - b), med = sorted[Math.floor(sorted.length / 2)];
    const top = Math.max(...gaps), bw = Math.max(1, Math.min(6, W / gaps.length));
    gaps.forEach((g, i) => {
      ctx.fillStyle = g > 2 * med ? COLORS.prefill : COLORS.decode;
      const h = Math.max(1, g / top * (H - 2));
      ctx.fillRect(i * bw, H - h, Math.max(1, bw - 1), h);
    });
  },
  markSlow(out, times) {
    const gaps = this.gaps(times);
    if (!gaps.length) return;
    const med = gaps.slice().sort((a, b) => a - b)[Math.floor(gaps.length / 2)];
    const toks = out.querySelectorAll(".tok");
    gaps.forEach((g, i) => { if (g > 2 * med && toks[i + 1]) toks[i + 1].classList.add("slow"); });
  },
};

// ---- start ----------------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  setupKey();
  chat.setup();
  feed.start();
  window.addEventListener("resize", () => view.draw());
});
