// The dashboard's one script. Every value from the API goes into the page as text (text nodes,
// textContent, setAttribute): never as markup, so a `<script>` from a log or a spec shows as itself.
"use strict";

const TOKEN_KEY = "orch-token";
const RUNS_EVERY_MS = 1000;  // the runs table: a change shows within 2 s
const RUN_EVERY_MS = 1500;
const LOG_EVERY_MS = 2000;
const ACTIVE = new Set(["pending", "preparing", "launching", "running", "cancelling"]);

// The token rides in the URL's fragment (never sent to a server); kept for this tab only.
(function takeToken() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
})();
const token = () => sessionStorage.getItem(TOKEN_KEY) || "";

// --- building blocks ---------------------------------------------------------------------------
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, kids);
  return el;
}

function svg(tag, attrs, ...kids) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  setAttrs(el, attrs);
  append(el, kids);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "href" && !String(v).startsWith("/")) throw new Error("links stay on the dashboard");
    else el.setAttribute(k, String(v));
  }
}

function append(el, kids) {
  for (const k of kids.flat(Infinity)) {
    if (k === null || k === undefined || k === false || k === "") continue;
    el.append(k instanceof Node ? k : String(k));  // a string becomes a text node
  }
}

const link = (path, ...text) => h("a", {href: path}, ...text);
const now = () => Date.now() / 1000;

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(5)));
  if (typeof v === "string") return v;
  return JSON.stringify(v);
}

function dur(s) {
  s = Math.max(0, Math.round(s));
  const hh = Math.floor(s / 3600), mm = Math.floor((s % 3600) / 60), ss = s % 60;
  const two = (n) => String(n).padStart(2, "0");
  return hh ? `${hh}:${two(mm)}:${two(ss)}` : `${mm}:${two(ss)}`;
}

function age(s) {
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) if (s >= size) return `${Math.round(s / size)}${unit}`;
  return `${Math.max(0, Math.round(s))}s`;
}

function clock(ts) {
  if (!ts) return "-";
  const d = new Date(ts * 1000);
  const t = d.toLocaleTimeString([], {hour12: false});
  return now() - ts > 86400 ? `${d.toLocaleDateString()} ${t}` : t;
}

function status(s, stalled) {
  return h("span", {}, h("span", {class: `status ${s}`}, s), stalled ? h("span", {class: "stalled"}, " stalled") : "");
}

function progress(p, progressAt, big) {
  if (!p) return "";
  const frac = p.total ? Math.min(Math.max(p.done / p.total, 0), 1) : null;
  let eta = p.eta_s;
  if (eta !== null && eta !== undefined && progressAt) eta = Math.max(0, eta - (now() - progressAt));
  const words = [p.label || "", p.total ? `${fmt(p.done)}/${fmt(p.total)}` : fmt(p.done),
    frac !== null ? `${(100 * frac).toFixed(1)}%` : "",
    p.rate_per_s ? `${p.rate_per_s.toFixed(2)}/s` : "",
    eta !== null && eta !== undefined ? `eta ${dur(eta)}` : ""];
  const bar = frac === null ? "" : h("span", {class: big ? "bar big" : "bar"}, fill(frac));
  return h("span", {class: "progress"}, bar, words.filter(Boolean).join(" "));
}

function fill(frac) {
  const el = h("span");
  el.style.width = `${(100 * frac).toFixed(1)}%`;  // CSSOM: allowed where style attributes are not
  return el;
}

function table(head, rows, attrs) {
  return h("table", attrs || {}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), h("tbody", {}, rows));
}

function kv(pairs) {
  return h("table", {class: "kv"}, h("tbody", {}, pairs.filter((p) => p[1] !== null && p[1] !== undefined && p[1] !== "")
    .map(([k, v]) => h("tr", {}, h("td", {}, k), h("td", {}, v)))));
}

function section(title, ...kids) {
  return h("section", {}, h("h2", {}, title), ...kids);
}

// --- talking to orch -----------------------------------------------------------------------------
let lastHeard = 0;

async function api(path, opts) {
  opts = opts || {};
  const headers = Object.assign({}, opts.headers || {});
  if (token()) headers["X-Orch-Token"] = token();
  const res = await fetch(path, Object.assign({}, opts, {headers, cache: "no-store"}));
  let body;
  try { body = await res.json(); } catch (e) { body = {error: `${res.status} ${res.statusText}`}; }
  if (!res.ok) throw new Error(body.error || String(res.status));
  lastHeard = now();
  return body;
}

// Run `fn` now and every `ms` after it finished (never two at once); errors are shown, and retried.
function every(ms, fn, where) {
  let stopped = false;
  const tick = async () => {
    try {
      if (await fn() === false) stopped = true;
      if (where) where.replaceChildren();
    } catch (e) {
      if (where) where.replaceChildren(h("p", {class: "error"}, String(e.message || e)));
    }
    if (!stopped) setTimeout(tick, ms);
  };
  tick();
}

setInterval(() => {
  const el = document.getElementById("live");
  if (!el || !lastHeard) return;
  const late = now() - lastHeard;
  el.textContent = late > 5 ? `no answer from orch for ${Math.round(late)} s` : `live · ${clock(lastHeard)}`;
  el.className = late > 5 ? "stale" : "";
}, 1000);

// --- charts: inline SVG --------------------------------------------------------------------------
// points: [[x, y], ...]; x a timestamp (time: true) or a number; labels: names of x values (categorical)
function chart(title, points, opts) {
  opts = opts || {};
  const W = opts.width || 380, H = 170, L = 52, R = 10, T = 8, B = 24;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
  const xl = (x) => opts.labels ? (opts.labels[x] ?? "") : opts.time ? clock(x) : fmt(x);
  const g = svg("svg", {width: W, height: H, viewBox: `0 0 ${W} ${H}`, class: "plot", "data-points": points.length});
  g.append(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#d0d7de"}),
           svg("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#d0d7de"}),
           svg("text", {x: L - 4, y: T + 8, "text-anchor": "end"}, fmt(y1)),
           svg("text", {x: L - 4, y: H - B, "text-anchor": "end"}, fmt(y0)));
  if (opts.labels) {
    opts.labels.forEach((name, i) => g.append(svg("text", {x: px(i), y: H - 8, "text-anchor": "middle"}, name)));
  } else {
    g.append(svg("text", {x: L, y: H - 8}, xl(x0)), svg("text", {x: W - R, y: H - 8, "text-anchor": "end"}, xl(x1)));
  }
  if (!opts.scatter && points.length > 1) {
    g.append(svg("polyline", {points: points.map((p) => `${px(p[0]).toFixed(1)},${py(p[1]).toFixed(1)}`).join(" "),
                              fill: "none", stroke: "#0969da", "stroke-width": 1.5}));
  }
  if (opts.scatter || points.length <= 80) {
    points.forEach((p, i) => {
      const best = opts.best !== undefined && opts.best === i;
      g.append(svg("circle", {cx: px(p[0]), cy: py(p[1]), r: best ? 5 : 3, fill: best ? "#1a7f37" : "#0969da"},
                   svg("title", {}, `${xl(p[0])}: ${fmt(p[1])}`)));
    });
  }
  return h("div", {class: "chart"}, h("div", {class: "title"}, title), g);
}

// --- the runs table ------------------------------------------------------------------------------
async function runsPage(main) {
  const params = new URLSearchParams(location.search);
  const facets = await api("/api/facets");
  const state = {};
  for (const k of ["status", "host", "playbook", "sweep", "q", "before", "after"]) state[k] = params.get(k) || "";
  const selected = new Set();

  const choose = (name, label, options) => {
    const el = h("select", {name, onchange: () => { state[name] = el.value; state.before = state.after = ""; go(); }},
      h("option", {value: ""}, `${label}: all`), options.map(([v, text]) => h("option", {value: v}, text)));
    el.value = state[name];
    return el;
  };
  const statusChoices = [[[...ACTIVE].join(","), "active"], ...facets.statuses.map((s) => [s, s])];
  const text = h("input", {type: "search", name: "q", placeholder: "text (spec, reason, last line)", value: state.q});
  let typing;
  text.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => { state.q = text.value; state.before = state.after = ""; go(); }, 250);
  });
  const compare = h("button", {disabled: true, onclick: () => { location.href = `/compare?ids=${[...selected].join(",")}`; }},
    "compare selected");
  const bar = h("div", {class: "filters"},
    choose("status", "status", statusChoices), choose("host", "host", facets.hosts.map((x) => [x, x])),
    choose("playbook", "playbook", facets.playbooks.map((x) => [x, x])),
    choose("sweep", "sweep", facets.sweeps.map((s) => [String(s.id), `${s.id} ${s.name} ${s.instance}`])), text, compare);
  const body = h("tbody", {id: "runs"});
  const count = h("span", {class: "muted"});
  const nav = {newest: h("button", {onclick: () => { state.before = state.after = ""; go(); }}, "newest"),
               newer: h("button", {}, "‹ newer"), older: h("button", {}, "older ›")};
  const problems = h("div");
  const head = ["", "id", "playbook", "host", "status", "phase", "progress", "metrics", "age", "duration", "sweep"];
  main.replaceChildren(h("h1", {}, "Runs"), bar, problems,
    h("table", {class: "runs"}, h("thead", {}, h("tr", {}, head.map((c) => h("th", {}, c)))), body),
    h("div", {class: "pager"}, nav.newest, nav.newer, nav.older, count));

  const query = () => {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(state)) if (v) q.set(k, v);
    return q.toString();
  };
  let generation = 0;
  async function refresh() {
    const mine = generation;
    const doc = await api(`/api/runs?${query()}`);
    if (mine !== generation) return;  // the filters changed while this was on its way
    body.replaceChildren(...doc.runs.map((r) => row(r, selected, () => { compare.disabled = selected.size < 2; })));
    if (!doc.runs.length) body.append(h("tr", {}, h("td", {colspan: 11, class: "muted"}, "no runs")));
    count.textContent = `${doc.count}${doc.count_capped ? "+" : ""} run${doc.count === 1 ? "" : "s"}`;
    nav.newer.disabled = doc.newer === null;
    nav.older.disabled = doc.older === null;
    nav.newer.onclick = () => { state.after = String(doc.newer); state.before = ""; go(); };
    nav.older.onclick = () => { state.before = String(doc.older); state.after = ""; go(); };
  }
  function go() {
    generation += 1;
    history.replaceState(null, "", `/${query() ? "?" + query() : ""}`);
    refresh().catch((e) => problems.replaceChildren(h("p", {class: "error"}, String(e.message))));
  }
  every(RUNS_EVERY_MS, refresh, problems);
}

function row(r, selected, changed) {
  const box = h("input", {type: "checkbox", onchange: () => {
    if (box.checked) selected.add(r.id); else selected.delete(r.id);
    changed();
  }});
  box.checked = selected.has(r.id);
  const end = r.ended_at || now();
  const metrics = Object.entries(r.metrics || {}).map(([k, v]) => `${k}=${fmt(v)}`).join(" ");
  let phase = r.phase || "";
  if (r.phase === "queued" && r.queue_reason) phase += ` (${r.queue_reason})`;
  const point = r.point ? Object.entries(r.point).map(([k, v]) => `${k}=${fmt(v)}`).join(" ") : "";
  return h("tr", {"data-run": r.id, "data-status": r.status},
    h("td", {}, box), h("td", {class: "num"}, link(`/runs/${r.id}`, r.id)), h("td", {}, r.playbook),
    h("td", {}, r.host), h("td", {class: "st", title: r.invalid || null}, status(r.shown_status || r.status, r.stalled),
      r.invalid ? h("span", {class: "error invalid"}, " invalid") : ""),
    h("td", {}, phase), h("td", {}, progress(r.progress, r.progress_at) || (r.last_line ? h("span", {class: "muted"}, r.last_line.slice(0, 60)) : "")),
    h("td", {}, metrics), h("td", {title: clock(r.created_at)}, age(now() - r.created_at)),
    h("td", {}, r.started_at ? dur(end - r.started_at) : ""),
    h("td", {}, r.sweep_id ? link(`/sweeps/${r.sweep_id}`, `${r.sweep_id}`, point ? ` ${point}` : "") : ""));
}

// --- a run ---------------------------------------------------------------------------------------
async function runPage(main, id) {
  const meta = await api("/api/meta");
  const parts = {};
  for (const k of ["head", "actions", "summary", "nodes", "timeline", "error", "log", "charts", "events", "spec",
                   "patches", "receipt", "outputs", "reproduce", "problems"]) parts[k] = h("div", {id: k});
  main.replaceChildren(parts.head, parts.problems, parts.actions, parts.summary, parts.nodes,
    section("Timeline", parts.timeline), parts.error, section("Log", parts.log), section("Metrics", parts.charts),
    section("Events", parts.events), section("Spec", parts.spec), section("Patch sets", parts.patches),
    section("Receipt", parts.receipt), section("Outputs", parts.outputs), section("Reproduce", parts.reproduce));
  let doc = null, shownActions = null;
  every(RUN_EVERY_MS, async () => {
    doc = await api(`/api/runs/${id}`);
    drawRun(parts, doc);
    const active = ACTIVE.has(doc.status);
    if (shownActions !== active) {
      shownActions = active;
      parts.actions.replaceChildren(...(meta.actions && active ? actionButtons(id) : []));
    }
    return active ? undefined : false;
  }, parts.problems);
  const log = h("pre", {class: "log", id: "log"});
  const logNote = h("div", {class: "muted"});
  const logProblems = h("div");
  parts.log.replaceChildren(logNote, logProblems, log);
  every(LOG_EVERY_MS, async () => {
    const tail = await api(`/api/runs/${id}/log?lines=200`);
    const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = tail.text || "";
    if (atEnd) log.scrollTop = log.scrollHeight;
    logNote.textContent = [tail.source === "stored" ? "the tail kept when the run ended" :
      tail.source === "host" ? `from the host, ${clock(tail.at)}` : "no log yet",
      tail.pending ? "(asking the host…)" : "", tail.error ? `host: ${tail.error}` : ""].filter(Boolean).join(" ");
    return doc && !ACTIVE.has(doc.status) && tail.source !== "host" ? false : undefined;
  }, logProblems);
  every(5000, async () => {
    const series = await api(`/api/runs/${id}/metrics`);
    const names = Object.keys(series);
    parts.charts.replaceChildren(h("div", {class: "charts"},
      names.length ? names.map((n) => chart(n, series[n], {time: true})) : h("p", {class: "muted"}, "no metrics")));
    return doc && !ACTIVE.has(doc.status) ? false : undefined;
  });
}

function drawRun(parts, d) {
  parts.head.replaceChildren(h("h1", {}, `Run ${d.id} `, h("span", {class: "muted"}, `${d.playbook} on ${d.host} `),
    status(d.shown_status || d.status, d.stalled)));
  const end = d.ended_at || now();
  parts.summary.replaceChildren(kv([
    ["invalid", d.invalid ? `${d.invalid} (its numbers count nowhere)` : null],
    ["phase", d.phase], ["progress", progress(d.progress, d.progress_at, true)],
    ["reason", d.reason], ["exit code", d.exit_code], [d.job_id ? "job" : "pid", d.job_id || d.pid],
    ["node", d.node], ["queue", d.queue_reason], ["remote dir", d.remote_dir],
    ["created", clock(d.created_at)], ["started", d.started_at ? clock(d.started_at) : null],
    ["ended", d.ended_at ? clock(d.ended_at) : null],
    ["duration", d.started_at ? dur(end - d.started_at) : null],
    ["last line", d.last_line], ["heard from host", d.heartbeat && ACTIVE.has(d.status) ? `${age(now() - d.heartbeat)} ago` : null],
    ["sweep", d.sweep_id ? link(`/sweeps/${d.sweep_id}`, `sweep ${d.sweep_id}`) : null],
    ["metrics", Object.entries(d.metrics).map(([k, v]) => `${k}=${fmt(v)}`).join("  ")],
  ]));
  // a multi-node run: one row per node (its own record), rank order; a node's record names its run
  parts.nodes.replaceChildren(...(d.nodes.length ? [section(`Nodes (${d.nodes.length})`,
    table(["rank", "run", "host", "status", "phase", "job", "progress", "reason", "remote dir"],
      d.nodes.map((n) => h("tr", {}, h("td", {}, `${n.rank}`), h("td", {}, link(`/runs/${n.id}`, `${n.id}`)),
        h("td", {}, n.host), h("td", {}, status(n.status, false)), h("td", {}, n.phase || ""), h("td", {}, n.job ?? ""),
        h("td", {}, progress(n.progress)), h("td", {}, n.reason || ""), h("td", {}, n.remote_dir || "")))))]
    : d.parent_id !== null ? [h("p", {}, `node ${d.node_rank} of `, link(`/runs/${d.parent_id}`, `run ${d.parent_id}`))]
    : []));
  parts.timeline.replaceChildren(timeline(d.timeline, d.ended_at || now()));
  parts.error.replaceChildren(...(d.error ? [section("Error", errorBox(d.error))] : []));
  parts.events.replaceChildren(table(["time", "kind", "message"],
    d.events.map((e) => h("tr", {}, h("td", {}, clock(e.ts)), h("td", {}, e.kind), h("td", {}, e.message)))));
  parts.spec.replaceChildren(table(["key", "value"], d.spec_keys.map((s) =>
    h("tr", {class: s.changed ? "changed" : ""}, h("td", {}, s.key), h("td", {}, h("code", {}, fmt(s.value)),
      s.changed ? "" : h("span", {class: "muted"}, "  (default)"))))));
  parts.patches.replaceChildren(d.patches.length ? table(["time", "action", "set", "package", "version", "file", "sha256 before", "sha256 after"],
    d.patches.map((p) => h("tr", {}, h("td", {}, clock(p.ts)), h("td", {}, p.action), h("td", {}, p.patch_set),
      h("td", {}, p.package), h("td", {}, p.version), h("td", {}, p.file),
      h("td", {}, h("code", {}, (p.sha_before || "").slice(0, 12))), h("td", {}, h("code", {}, (p.sha_after || "").slice(0, 12))))))
    : h("p", {class: "muted"}, "none"));
  // what produced the numbers: engine, patches, argv, model, data set, hardware (a benchmark: its server's too)
  parts.receipt.replaceChildren(d.receipt ? h("pre", {id: "receipt-json"}, JSON.stringify(d.receipt, null, 2))
    : h("p", {class: "muted"}, "none recorded"));
  parts.outputs.replaceChildren(d.outputs ? h("pre", {}, JSON.stringify(d.outputs, null, 2)) : h("p", {class: "muted"}, "none"));
  parts.reproduce.replaceChildren(h("pre", {id: "reproduce"}, d.reproduce), h("p", {class: "muted"},
    `orch status ${d.id} · orch logs ${d.id} -f · orch compare ${d.id} OTHER`));
}

function timeline(steps, end) {
  const bar = h("div", {class: "timeline"});
  const list = [];
  const total = Math.max(end - steps[0].ts, 1e-3);
  steps.forEach((s, i) => {
    const last = i === steps.length - 1;
    const until = last ? end : steps[i + 1].ts;
    const took = Math.max(until - s.ts, 0);
    list.push(h("tr", {}, h("td", {}, s.phase), h("td", {}, clock(s.ts)), h("td", {}, last && !ACTIVE.has(s.phase) && i > 0 ? "" : dur(took))));
    if (last && i > 0 && !["ready", "running", "loading", "starting", "capturing", "queued"].includes(s.phase)) return;
    const seg = h("div", {class: `ph-${s.phase.replace(/[^a-z]/g, "")}`, title: `${s.phase} from ${clock(s.ts)} for ${dur(took)}`}, s.phase);
    seg.style.flex = `${Math.max(took, total * 0.04)} 1 0px`;
    bar.append(seg);
  });
  return h("div", {}, bar, table(["phase", "from", "for"], list));
}

function errorBox(e) {
  const lines = (e.context || []).map((l) => h("div", {class: e.message && l.includes(e.message) ? "errline" : ""}, l || " "));
  return h("div", {class: "errbox"},
    h("div", {}, h("b", {}, e.kind), " ", e.exception || "", " ", e.message || "",
      e.line ? h("span", {class: "muted"}, ` (log line ${e.line})`) : ""),
    (e.chain || []).map((c) => h("div", {class: "muted"}, `then: ${c}`)),
    e.hint ? h("div", {class: "hint"}, h("b", {}, "try: "), e.hint) : "",
    lines.length ? h("pre", {}, lines) : "");
}

function actionButtons(id) {
  const out = h("span", {class: "muted"});
  const act = async (action) => {
    if (!confirm(`${action} run ${id}?`)) return;
    if (!token()) {
      const t = prompt("the token `orch ui` printed when it started");
      if (!t) return;
      sessionStorage.setItem(TOKEN_KEY, t);
    }
    out.textContent = `${action}…`;
    try {
      const res = await api(`/api/runs/${id}/${action}`, {method: "POST"});
      out.textContent = `${action}: ${res.outcome}`;
    } catch (e) {
      out.textContent = `${action} refused: ${e.message}`;
    }
  };
  return [h("button", {class: "danger", onclick: () => act("cancel")}, "cancel"),
          h("button", {class: "danger", onclick: () => act("stop")}, "stop (free its GPUs)"), out];
}

// --- sweeps --------------------------------------------------------------------------------------
async function sweepsPage(main) {
  const docs = await api("/api/sweeps");
  main.replaceChildren(h("h1", {}, "Sweeps"), table(["id", "name", "instance", "playbook", "status", "points", "created"],
    docs.map((d) => h("tr", {}, h("td", {class: "num"}, link(`/sweeps/${d.id}`, d.id)), h("td", {}, d.name),
      h("td", {}, d.instance), h("td", {}, d.playbook), h("td", {}, status(d.status)),
      h("td", {}, Object.entries(d.counts).map(([s, n]) => `${n} ${s}`).join(", ")), h("td", {}, clock(d.created_at))))));
  if (!docs.length) main.append(h("p", {class: "muted"}, "no sweeps yet"));
}

async function sweepPage(main, id) {
  const params = new URLSearchParams(location.search);
  let objective = params.get("objective") || "";
  const problems = h("div");
  const body = h("div");
  main.replaceChildren(problems, body);
  const draw = async () => {
    const d = await api(`/api/sweeps/${id}${objective ? "?objective=" + encodeURIComponent(objective) : ""}`);
    objective = d.objective || "";
    const pick = h("select", {name: "objective", onchange: () => {
      objective = pick.value;
      history.replaceState(null, "", `/sweeps/${id}?objective=${encodeURIComponent(objective)}`);
      draw().catch((e) => problems.replaceChildren(h("p", {class: "error"}, String(e.message))));
    }}, d.metrics.map((m) => h("option", {value: m}, d.direction[m] ? `${m} (${d.direction[m]} is better)` : `${m} (a count or setting)`
      + (d.declared && d.declared.metric === m ? " — the sweep's objective" : ""))));
    pick.value = objective;
    const bestRow = objective ? d.best[objective] : null;
    const rows = d.points.map((p) => h("tr", {class: p.index === bestRow ? "best" : "", "data-point": p.index},
      h("td", {class: "num"}, p.index, p.index === bestRow ? " ★" : ""),
      d.keys.map((k) => h("td", {}, fmt((p.point || {})[k]))),
      h("td", {title: p.invalid || null}, status(p.status), p.cause ? ` (${p.cause})` : "",
        p.invalid ? h("span", {class: "error invalid"}, " invalid") : ""),
      h("td", {}, p.run_id ? link(`/runs/${p.run_id}`, `run ${p.run_id}`) : "-"),
      h("td", {}, p.host), h("td", {class: "num"}, p.attempts),
      d.metrics.map((m) => {
        const best = d.best[m] === p.index && m in p.metrics;
        return h("td", {class: best ? "num best" : "num", title: best ? `best ${m}` : null}, fmt(p.metrics[m]), best ? " ★" : "");
      })));
    const charts = objective ? d.keys.map((k) => {
      const labels = [...new Set(d.points.map((p) => fmt((p.point || {})[k])))];
      const scored = d.points.filter((p) => objective in p.metrics);
      const pts = scored.map((p) => [labels.indexOf(fmt((p.point || {})[k])), p.metrics[objective]]);
      const best = scored.findIndex((p) => p.index === bestRow);
      return pts.length ? chart(`${objective} by ${k}`, pts, {labels, scatter: true, best}) : "";
    }) : [];
    const trend = d.trend.length > 1 ? chart(`best ${objective} over the sweeps named ${d.name}`,
      d.trend.map((t) => [t.created_at, t.best]), {time: true}) : "";
    // a search: what it found, and its objective trial by trial
    const byTrial = d.search ? d.search.history.filter((t) => t.objective !== null).map((t) => [t.index, t.objective]) : [];
    const found = d.search ? section("Search", h("div", {class: "search"},
      d.search_lines.map((line) => h("p", {}, line)),
      byTrial.length ? chart(`${d.declared.metric} by trial`, byTrial, {scatter: true}) : "")) : "";
    body.replaceChildren(
      h("h1", {}, `Sweep ${d.id} `, h("span", {class: "muted"}, `${d.name} ${d.instance} (${d.playbook}) `), status(d.status)),
      h("div", {class: "filters"}, "objective: ", d.metrics.length ? pick : h("span", {class: "muted"}, "no metrics yet")),
      table(["#", ...d.keys, "status", "run", "host", "tries", ...d.metrics], rows, {class: "pivot"}),
      found,
      section("Charts", h("div", {class: "charts"}, charts, trend)));
    return ACTIVE.has(d.status) ? undefined : false;  // a finished sweep no longer changes
  };
  every(3000, draw, problems);
}

// --- hosts ---------------------------------------------------------------------------------------
async function hostsPage(main) {
  const hosts = await api("/api/hosts");
  const detail = {};
  const rows = hosts.map((x) => {
    detail[x.name] = h("div", {id: `gpus-${x.name}`});
    const runs = Object.entries(x.runs).map(([s, n]) => `${n} ${s}`).join(", ");
    return [h("tr", {}, h("td", {}, h("b", {}, x.name)), h("td", {}, x.address), h("td", {class: "num"}, x.gpus),
      h("td", {}, (x.tags || []).join(", ")), h("td", {}, x.scheduler || ""),
      h("td", {}, link(`/?host=${encodeURIComponent(x.name)}`, runs || "none")),
      h("td", {}, h("button", {onclick: () => gpus([x.name], detail)}, "GPUs"), " ",
        h("button", {onclick: () => reach([x.name], detail)}, "check"))),
      h("tr", {}, h("td", {colspan: 7}, detail[x.name]))];
  });
  main.replaceChildren(h("h1", {}, "Hosts"), h("div", {class: "actions"},
    h("button", {onclick: () => gpus(hosts.map((x) => x.name), detail)}, "GPUs of every host"),
    h("button", {onclick: () => reach(hosts.map((x) => x.name), detail)}, "check every host")),
  table(["host", "address", "gpus", "tags", "scheduler", "runs", ""], rows));
}

async function gpus(names, detail) {
  names.forEach((n) => detail[n].replaceChildren(h("span", {class: "muted"}, "asking the host…")));
  const q = names.map((n) => `host=${encodeURIComponent(n)}`).join("&");
  let found;
  try { found = await api(`/api/hosts/gpus?${q}`); } catch (e) {
    names.forEach((n) => detail[n].replaceChildren(h("span", {class: "error"}, e.message)));
    return;
  }
  for (const [name, res] of Object.entries(found)) {
    if (res.error) { detail[name].replaceChildren(h("span", {class: "error"}, res.error)); continue; }
    if (!res.snapshot) { detail[name].replaceChildren(h("span", {class: "muted"}, "no GPUs (no nvidia-smi)")); continue; }
    detail[name].replaceChildren(table(["gpu", "utilisation", "memory", "processes"], res.snapshot.gpus.map((g) => {
      const frac = g.memory_total_mib ? g.memory_used_mib / g.memory_total_mib : 0;
      return h("tr", {"data-gpu": g.index}, h("td", {class: "num"}, g.index), h("td", {class: "num"}, g.utilization_pct === null ? "-" : `${g.utilization_pct}%`),
        h("td", {}, h("span", {class: "bar"}, fill(frac)), `${fmt(g.memory_used_mib)} / ${fmt(g.memory_total_mib)} MiB`),
        h("td", {}, g.processes.map((p) => h("div", {}, `pid ${p.pid} `, p.user || "?", " ", (p.command || "").slice(0, 80), " ",
          p.used_memory_mib !== null ? `${p.used_memory_mib} MiB ` : "",
          p.run_id ? link(`/runs/${p.run_id}`, `run ${p.run_id}`) : h("span", {class: "muted"}, "not orch's")))));
    })), h("div", {class: "muted"}, `as of ${clock(res.snapshot.taken_at)}`));
  }
}

async function reach(names, detail) {
  const q = names.map((n) => `host=${encodeURIComponent(n)}`).join("&");
  try {
    const found = await api(`/api/hosts/check?${q}`);
    for (const [name, r] of Object.entries(found)) {
      detail[name].replaceChildren(r.ok ? h("span", {}, `reachable in ${r.seconds} s: ${r.uname}`) : h("span", {class: "error"}, `unreachable: ${r.error}`));
    }
  } catch (e) {
    names.forEach((n) => detail[n].replaceChildren(h("span", {class: "error"}, e.message)));
  }
}

// --- compare -------------------------------------------------------------------------------------
async function comparePage(main) {
  const params = new URLSearchParams(location.search);
  const ids = h("input", {name: "ids", value: params.get("ids") || "", placeholder: "run ids: 7, 9, 12"});
  const all = h("input", {type: "checkbox", name: "all"});
  all.checked = params.get("all") === "1";
  const out = h("div");
  const go = async () => {
    const q = `ids=${encodeURIComponent(ids.value)}${all.checked ? "&all=1" : ""}`;
    history.replaceState(null, "", `/compare?${q}`);
    if (!ids.value.trim()) { out.replaceChildren(h("p", {class: "muted"}, "two or more run ids; ratios are against the first")); return; }
    try { drawCompare(out, await api(`/api/compare?${q}`)); } catch (e) { out.replaceChildren(h("p", {class: "error"}, e.message)); }
  };
  ids.addEventListener("change", go);
  all.addEventListener("change", go);
  main.replaceChildren(h("h1", {}, "Compare"), h("div", {class: "filters"}, ids, h("label", {}, all, " every spec key"),
    h("button", {onclick: go}, "compare")), out);
  go();
}

function drawCompare(out, c) {
  const head = ["", ...c.runs.map((i) => link(`/runs/${i}`, `run ${i}`))];
  const rows = Object.entries(c.spec).map(([k, vs]) => h("tr", {}, h("td", {}, k), vs.map((v) => h("td", {}, h("code", {}, fmt(v))))));
  if (rows.length && Object.keys(c.metrics).length) rows.push(h("tr", {}, h("td", {colspan: head.length}, "")));
  for (const [name, m] of Object.entries(c.metrics)) {
    // green where better than the first run beyond the noise, red where worse, in the metric's own direction
    const way = (i) => (m.verdicts[i] === "better" ? " better" : m.verdicts[i] === "worse" ? " worse" : "");
    rows.push(h("tr", {}, h("td", {}, h("b", {}, name), h("span", {class: "muted"}, m.lower_is_better ? " ↓" : " ↑")),
      m.values.map((v, i) => h("td", {class: "num" + way(i)}, fmt(v),
        i && m.ratios[i] !== null ? h("span", {class: "muted"}, ` (${m.ratios[i].toFixed(2)}x)`) : "",
        i && m.verdicts[i] ? h("span", {class: "verdict", title: m.why[i] || ""}, ` ${m.verdicts[i]}`) : ""))));
  }
  const changed = c.differences.map((d) => h("li", {}, h("code", {}, d.key), `: ${fmt(d.a)} → ${fmt(d.b)}`,
    d.run ? ` (run ${d.run})` : "", d.matters ? h("b", {}, ` incomparable: ${d.matters}`) : ""));
  const invalid = c.runs.map((id, i) => c.invalid[i] ? h("li", {class: "error"}, `run ${id} is invalid: ${c.invalid[i]}`) : null)
    .filter(Boolean);
  out.replaceChildren(h("ul", {id: "differences"}, ...invalid, ...changed), table(head, rows, {class: "compare"}));
}

// --- the router ----------------------------------------------------------------------------------
const ROUTES = [[/^\/$/, runsPage], [/^\/runs\/(\d+)$/, runPage], [/^\/sweeps$/, sweepsPage],
                [/^\/sweeps\/(\d+)$/, sweepPage], [/^\/hosts$/, hostsPage], [/^\/compare$/, comparePage]];

document.addEventListener("DOMContentLoaded", () => {
  const main = document.getElementById("main");
  for (const [re, page] of ROUTES) {
    const m = location.pathname.match(re);
    if (m) {
      page(main, ...m.slice(1)).catch((e) => main.replaceChildren(h("p", {class: "error"}, String(e.message || e))));
      return;
    }
  }
  main.replaceChildren(h("p", {}, "no such page"));
});
