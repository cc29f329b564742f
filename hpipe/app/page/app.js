// hpipe's page: a chat over /v1/chat/completions (streamed) and the cluster from /api/live.
// Plain browser JavaScript, no build step; charts by uPlot (vendor/).
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const COLORS = ["#2f6fde", "#e07b24", "#1e8e4f", "#b03aa8", "#c0392b", "#16869a", "#7a6a00", "#5b5bd6"];

// --- the API key (where the server has one): kept in this tab only ---------------------------
let key = sessionStorage.getItem("hpipe-key") || "";
function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}
function needKey(message) {
  $("key-box").hidden = false;
  $("key-error").textContent = message || "";
}
$("key-save").onclick = () => {
  key = $("key").value.trim();
  sessionStorage.setItem("hpipe-key", key);
  $("key-box").hidden = true;
  loadModel();
};

// --- tabs ------------------------------------------------------------------------------------
for (const tab of document.querySelectorAll(".tab")) {
  tab.onclick = () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const v of document.querySelectorAll(".view")) v.hidden = v.id !== "view-" + tab.dataset.view;
    if (tab.dataset.view === "cluster") resizeCharts();
  };
}

// --- formatting --------------------------------------------------------------------------------
function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return n.toFixed(n < 10 && i ? 1 : 0) + " " + units[i];
}
function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(0) + "%"; }
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c instanceof Node ? c : String(c));
  return e;
}

// --- the chat ------------------------------------------------------------------------------------
let model = null;
let history = [];      // {role, content} of the conversation so far
let controller = null; // the answer being streamed (Stop aborts it)

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) return needKey("the key was not accepted");
    const body = await r.json();
    model = body.data[0].id;
    $("model").textContent = model;
  } catch (e) { $("model").textContent = "(server not reachable)"; }
}

function requestMessages() {
  const system = [$("system").value.trim(), $("documents").value.trim()].filter(Boolean).join("\n\n");
  return (system ? [{ role: "system", content: system }] : []).concat(history);
}

function samplingFields() {
  const body = {
    max_tokens: parseInt($("max_tokens").value, 10) || 256,
    temperature: parseFloat($("temperature").value),
    top_p: parseFloat($("top_p").value),
    top_k: parseInt($("top_k").value, 10),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = parseInt(seed, 10);
  return body;
}

async function ask(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  if (!model) await loadModel();
  $("prompt").value = "";
  history.push({ role: "user", content: text });
  $("messages").append(el("div", { class: "msg user" }, text));
  const answer = el("div", { class: "msg assistant" });
  const content = el("span", { class: "content" });
  const stats = el("div", { class: "stats" }, "waiting for the first token…");
  answer.append(content, stats);
  $("messages").append(answer);
  answer.scrollIntoView();
  controller = new AbortController();
  $("send").disabled = true; $("stop").disabled = false;
  const sent = performance.now();
  let first = null, usage = null, finish = null, pieces = 0;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(Object.assign({ model, messages: requestMessages(), stream: true,
                                           stream_options: { include_usage: true } }, samplingFields())),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      if (r.status === 401) needKey("the key was not accepted");
      throw new Error((body.error && body.error.message) || r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = (choice.delta && choice.delta.content) || "";
          if (delta) {
            if (first === null) first = performance.now();
            content.textContent += delta;
            answer.dataset.pieces = ++pieces;
            stats.textContent = "streaming…";
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    showStats(stats, sent, first, performance.now(), usage, finish);
  } catch (e) {
    if (e.name === "AbortError") showStats(stats, sent, first, performance.now(), null, "stopped");
    else { stats.textContent = "error: " + e.message; stats.classList.add("error"); }
  } finally {
    history.push({ role: "assistant", content: content.textContent });
    controller = null;
    $("send").disabled = false; $("stop").disabled = true;
  }
}

function showStats(stats, sent, first, end, usage, finish) {
  const parts = [];
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    parts.push(`prompt ${usage.prompt_tokens} tokens` + (cached ? ` (${cached} from the prefix cache)` : ""));
    parts.push(`answer ${usage.completion_tokens} tokens`);
  }
  if (first !== null) {
    parts.push(`first token ${((first - sent) / 1000).toFixed(2)} s`);
    const n = usage ? usage.completion_tokens : null;
    if (n && n > 1 && end > first) parts.push(`${((n - 1) / ((end - first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (finish) parts.push(finish);
  stats.textContent = parts.join(" · ");
  stats.dataset.done = "1";
}

$("ask").onsubmit = ask;
$("prompt").onkeydown = (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask").requestSubmit(); } };
$("stop").onclick = () => controller && controller.abort();
$("clear").onclick = () => { history = []; $("messages").replaceChildren(); };

// documents dropped in: their text goes into the documents box
const settings = document.querySelector(".settings");
settings.addEventListener("dragover", (e) => { e.preventDefault(); settings.classList.add("dragging"); });
settings.addEventListener("dragleave", () => settings.classList.remove("dragging"));
settings.addEventListener("drop", async (e) => {
  e.preventDefault();
  settings.classList.remove("dragging");
  for (const file of e.dataTransfer.files) {
    const text = await file.text();
    $("documents").value += ($("documents").value ? "\n\n" : "") + `[${file.name}]\n` + text;
  }
});

// --- the cluster ------------------------------------------------------------------------------------
const charts = {};
let colorOf = {};

function chart(id, series) {
  const node = $(id);
  const opts = {
    width: Math.max(300, node.clientWidth || 440), height: 180, legend: { live: false },
    scales: { x: { time: true } },
    axes: [{}, { size: 50 }],
    series: [{}].concat(series.map((s) => ({ label: s.label, stroke: s.color, width: 2, spanGaps: false }))),
  };
  return new uPlot(opts, [[]].concat(series.map(() => [])), node);
}

function resizeCharts() {
  for (const [id, c] of Object.entries(charts)) {
    const w = $(id).clientWidth;
    if (w) c.setSize({ width: w, height: 180 });
  }
}
window.addEventListener("resize", resizeCharts);

function ensureCharts(names) {
  const busyKey = names.join(",");
  if (!charts["chart-tokens"]) {
    charts["chart-tokens"] = chart("chart-tokens", [{ label: "tokens/s", color: COLORS[0] }]);
    charts["chart-requests"] = chart("chart-requests", [{ label: "waiting", color: COLORS[1] },
                                                        { label: "running", color: COLORS[0] }]);
    charts["chart-kv"] = chart("chart-kv", [{ label: "blocks used", color: COLORS[2] }]);
  }
  if (!charts["chart-busy"] || charts["chart-busy"].names !== busyKey) {
    if (charts["chart-busy"]) { charts["chart-busy"].destroy(); $("chart-busy").replaceChildren(); }
    charts["chart-busy"] = chart("chart-busy", names.map((n) => ({ label: n, color: colorOf[n] })));
    charts["chart-busy"].names = busyKey;
  }
}

function drawCharts(live, names) {
  ensureCharts(names);
  const s = live.series;
  const t = s.map((p) => p.t);
  charts["chart-tokens"].setData([t, s.map((p) => p.tokens_per_s)]);
  charts["chart-requests"].setData([t, s.map((p) => p.waiting), s.map((p) => p.running)]);
  charts["chart-kv"].setData([t, s.map((p) => p.kv_used)]);
  charts["chart-busy"].setData([t].concat(names.map((n) => s.map((p) => (p.busy[n] ?? null)))));
}

function layoutBar(label, stages, units, extra) {
  const bar = el("div", { class: "bar" });
  for (const st of stages) {
    const [a, b] = st.units;
    const part = el("div", { style: `flex:${b - a} 0 0; background:${colorOf[st.daemon] || "#888"}`,
                             title: `${st.daemon}: units ${a}-${b}`, class: "stage", "data-daemon": st.daemon },
                    `${st.daemon} · units ${a}–${b}`, extra ? el("small", {}, extra(st)) : null);
    bar.append(part);
  }
  return el("div", { class: "layout" }, el("div", { class: "label" }, label), bar);
}

function drawPlan(live) {
  const plan = live.plan;
  const busy = Object.fromEntries(live.daemons.map((d) => [d.name, d.busy]));
  $("plan-note").textContent = `${plan.strategy}: ${plan.units} units, ${plan.micro_batches} micro-batch(es), ` +
    `planned for ${plan.max_len} tokens`;
  const parts = [layoutBar(plan.seesaw ? "serving layout" : "stages (predicted share of compute · measured busy now)",
                           plan.stages, plan.units,
                           (st) => `${st.layers} · pred ${pct(st.predicted_share)} · busy ${pct(busy[st.daemon])}`)];
  if (plan.seesaw) {
    const named = (lay) => lay.map((s) => ({ daemon: s.daemon, units: s.units }));
    parts.push(layoutBar("Seesaw prefill layout", named(plan.seesaw.prefill), plan.units));
    parts.push(layoutBar("Seesaw decode layout", named(plan.seesaw.decode), plan.units));
  }
  $("plan").replaceChildren(...parts);
}

function drawDaemons(live) {
  const cards = live.daemons.map((d) => {
    const used = (d.pools || []).reduce((a, p) => a + p.used, 0);
    const blocks = (d.pools || []).reduce((a, p) => a + p.blocks, 0);
    const busy = d.busy === null || d.busy === undefined ? 0 : d.busy;
    return el("div", { class: "card daemon" + (d.up ? "" : " down"), "data-name": d.name },
      el("div", { class: "big", style: `color:${colorOf[d.name]}` }, d.name),
      el("div", { class: "muted" }, d.address + (d.up ? "" : " · " + (d.why || "down"))),
      el("dl", {},
        el("dt", {}, "device"), el("dd", {}, d.device ? `${d.device}${d.device === "cpu" ? `, ${d.threads} thread${d.threads === 1 ? "" : "s"}` : ""}` : "–"),
        el("dt", {}, ""), el("dd", { class: "muted" }, d.device_name || ""),
        el("dt", {}, "weights"), el("dd", {}, bytes(d.weight_bytes)),
        el("dt", {}, "KV cache"), el("dd", {}, `${bytes(d.kv_bytes)} · ${used}/${blocks} blocks`),
        el("dt", {}, "held"), el("dd", {}, bytes(d.resident_bytes)),
        el("dt", {}, "free"), el("dd", {}, bytes(d.free_bytes)),
        el("dt", {}, "busy"), el("dd", { class: "busy", "data-value": d.busy === null ? "" : String(d.busy) },
                                  pct(d.busy), el("div", { class: "meter" }, el("div", { style: `width:${100 * busy}%` })))));
  });
  $("daemons").replaceChildren(...cards);
}

function drawLinks(live) {
  const order = live.plan.stages.map((s) => s.daemon);
  const cuts = new Set(order.slice(1).map((n, i) => order[i] + ">" + n));
  const rows = live.plan.links.map((l) => el("tr", { class: cuts.has(l.src + ">" + l.dst) ? "cut" : "" },
    el("td", {}, l.src), el("td", {}, l.dst), el("td", {}, `${(8 * l.bandwidth_Bps / 1e6).toFixed(0)} Mbit/s`),
    el("td", {}, `${(1000 * l.latency_s).toFixed(2)} ms`),
    el("td", { class: "muted" }, cuts.has(l.src + ">" + l.dst) ? "a cut of the plan" : "")));
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: 5, class: "muted" }, "the plan has no measured links")));
  document.querySelector("#links tbody").replaceChildren(...rows);
}

function drawSummary(live) {
  const last = live.series.length ? live.series[live.series.length - 1] : { tokens_per_s: 0 };
  const card = (label, value, id) => el("div", { class: "card", id }, el("div", { class: "muted" }, label),
                                        el("div", { class: "big" }, value));
  const t = live.totals;
  $("summary").replaceChildren(...[
    card("state", live.state === "ok" ? live.health : live.state, "sum-state"),
    card("answer tokens/s", last.tokens_per_s.toFixed(1), "sum-rate"),
    card("requests waiting · running", `${live.waiting} · ${live.running}`, "sum-requests"),
    card("tokens generated · prompt (cached)", `${t.generated} · ${t.prompt} (${t.cached})`, "sum-tokens"),
    card("recoveries · preemptions", `${t.recoveries} · ${t.preemptions}`, "sum-recoveries"),
    live.phase ? card("Seesaw phase", live.phase, "sum-phase") : null].filter(Boolean));
}

function drawEvents(live) {
  const items = live.events.slice().reverse().map((e) =>
    el("li", { class: e.kind }, `${new Date(e.t * 1000).toLocaleTimeString()} ${e.text}`));
  if (!items.length) items.push(el("li", { class: "muted" }, "nothing yet"));
  $("events").replaceChildren(...items);
}

function draw(live) {
  if (!live.chat && !$("tab-chat").hidden) {  // a job's page (hpipe run --serve-page): the cluster only
    $("tab-chat").hidden = true;
    $("tab-cluster").click();
    $("model").textContent = live.plan.model + " · a job";
  } else if (live.chat && !model) loadModel();
  const names = [...new Set(live.plan.stages.map((s) => s.daemon))];
  names.forEach((n, i) => { colorOf[n] = COLORS[i % COLORS.length]; });
  const ok = live.state === "ok" && live.health === "ok";
  $("health").textContent = ok ? `${names.length} daemons · ok` : (live.state === "ok" ? live.health : live.state);
  $("health").className = "pill " + (ok ? "ok" : "bad");
  drawSummary(live);
  drawPlan(live);
  drawDaemons(live);
  drawLinks(live);
  drawCharts(live, names);
  drawEvents(live);
}

async function poll() {
  try {
    const r = await fetch("/api/live", { headers: headers(), cache: "no-store" });
    if (r.status === 401) needKey(key ? "the key was not accepted" : "");
    else if (r.ok) { const live = await r.json(); if (live.plan) draw(live); }
  } catch (e) {
    $("health").textContent = "server not reachable";
    $("health").className = "pill bad";
  }
  setTimeout(poll, POLL_MS);
}

poll();
