// hcache dashboard: polls /api/dashboard every 2 s and redraws. No build step, no CDN.
"use strict";

const MIXES = ["RE", "H", "KV", "RE+H", "RE+KV", "H+KV", "RE+H+KV"];
const COLORS = ["#c62828", "#1565c0", "#2e7d32", "#8e24aa", "#ef6c00", "#00838f", "#6d4c41"];
// charts slide over the last few minutes, labelled with the time of day: auto-ranged over a
// few sparse points, uPlot's time axis spanned years
const WINDOW_S = 300;
let mixPlot = null;
let latPlot = null;
let latest = Date.now() / 1000;

function clock(t, seconds) {
  const opts = { hour: "2-digit", minute: "2-digit", hourCycle: "h23" };
  if (seconds) opts.second = "2-digit";
  return new Date(t * 1000).toLocaleTimeString([], opts);
}

function timeAxis(el) {
  return {
    space: 60,
    incrs: [10, 15, 30, 60, 120, 300],
    values: (u, splits, axisIdx, space, incr) => {
      const labels = splits.map((t) => clock(t, incr < 60));
      el.dataset.xLabels = labels.join("|");
      return labels;
    },
  };
}

function fmtBytes(n) {
  if (n == null) return "-";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function tileRow(id, items) {
  const box = document.getElementById(id);
  box.replaceChildren(...items.map(([k, v, bad]) => {
    const d = document.createElement("div");
    d.className = "tile" + (bad ? " bad" : "");
    d.dataset.key = k;
    const b = document.createElement("b");
    b.textContent = v;
    d.append(b, k);
    return d;
  }));
}

// cluster mode (`hcache serve --cluster`): reachability, this replica, leases and record traffic
function cluster(c) {
  const section = document.getElementById("cluster");
  section.hidden = !c;
  if (!c) return;
  tileRow("cluster-tiles", [
    ["state", c.up ? "up" : "unreachable", !c.up],
    ["replica", c.replica],
    ["cluster", c.url],
    ["commits", c.commits],
    ["lease takeovers", c.takeovers],
    ["lease conflicts", c.lease_conflicts],
    ["fenced commits", c.refused_commits, c.refused_commits > 0],
    ["errors", c.errors, c.errors > 0],
    ["adopted sessions", c.adoptions],
    ["recomputed tokens", c.recomputed_tokens],
    ["read / written", `${fmtBytes(c.bytes_read)} / ${fmtBytes(c.bytes_written)}`],
  ]);
  section.title = c.problems.join("\n");
}

function tiles(t) {
  const items = [
    ["sessions", t.sessions], ["resident", t.resident_sessions],
    ["resident KV", `${fmtBytes(t.resident_bytes)} / ${fmtBytes(t.budget_bytes)}`],
    ["restores", t.restores], ["evictions", t.evictions],
    ["fallback layers", t.fallback_layers, t.fallback_layers > 0],
    ["checksum failures", t.checksum_failures, t.checksum_failures > 0],
    ["store", `${fmtBytes(t.store_occupied_bytes)} / ${fmtBytes(t.store_capacity_bytes)}`],
    ["released", `${fmtBytes(t.bytes_released)} · ${t.demotions} demotions`],
    ["expired sessions", t.expiries],
    ["resent chats matched", `${t.prefix_matches} · ${t.prefix_tokens} tokens shared`],
    ["tokens generated", t.generated_tokens],
    ["queue", Object.entries(t.queue_depth).map(([k, v]) => `${k} ${v}`).join(" · ")],
  ];
  const box = document.getElementById("tiles");
  box.replaceChildren(...items.map(([k, v, bad]) => {
    const d = document.createElement("div");
    d.className = "tile" + (bad ? " bad" : "");
    d.dataset.key = k;
    const b = document.createElement("b");
    b.textContent = v;
    d.append(b, k);
    return d;
  }));
}

function tableRows(id, rows, fill) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(...rows.map((r) => { const tr = document.createElement("tr"); fill(tr, r); return tr; }));
}

function chart(el, series, data, old) {
  const width = el.clientWidth || 500;
  const same = old && old.series.length === series.length + 1 &&
    series.every((s, i) => old.series[i + 1].label === s.label);
  if (same) { old.setData(data); return old; }
  if (old) old.destroy();
  return new uPlot({
    width, height: 220,
    scales: { x: { time: true, range: () => [latest - WINDOW_S, latest] } },
    series: [{}, ...series.map((s) => ({ points: { show: true }, ...s }))],
    axes: [timeAxis(el), { size: 50 }],
  }, data, el);
}

function draw(d) {
  latest = d.time;
  document.getElementById("model").textContent = `${d.model}${d.draining ? " — draining" : ""}`;
  const st = document.getElementById("status");
  st.textContent = `updated ${new Date(d.time * 1000).toLocaleTimeString()}`;
  st.className = "";
  tiles(d.totals);
  cluster(d.cluster);
  tableRows("storage", d.storage, (tr, s) => {
    cell(tr, s.path);
    cell(tr, fmtBytes(s.used_bytes), "num");
    cell(tr, fmtBytes(s.free_bytes), "num");
    cell(tr, s.chunks, "num");
    cell(tr, s.read_mbps.toFixed(1), "num");
    cell(tr, s.write_mbps.toFixed(1), "num");
  });
  tableRows("sessions", d.sessions, (tr, s) => {
    cell(tr, "").appendChild(Object.assign(document.createElement("code"), { textContent: s.id }));
    cell(tr, s.kind);
    cell(tr, s.tokens, "num");
    const res = cell(tr, "");
    res.appendChild(Object.assign(document.createElement("span"), { className: "dot" + (s.resident ? " on" : "") }));
    res.append(s.resident ? " yes" : " no");
    cell(tr, s.turns, "num");
    cell(tr, s.plan || "-");
    cell(tr, s.restore_ms == null ? "-" : s.restore_ms.toFixed(1), "num");
  });
  const h = d.history.filter((b) => b.t >= latest - WINDOW_S);
  const xs = h.map((b) => b.t);
  const mixes = MIXES.filter((m) => h.some((b) => b.mix[m])).concat(
    [...new Set(h.flatMap((b) => Object.keys(b.mix)))].filter((m) => !MIXES.includes(m)));
  const mixSeries = mixes.map((m, i) => ({ label: m, stroke: COLORS[i % COLORS.length], width: 2 }));
  mixPlot = chart(document.getElementById("mix"), mixSeries.length ? mixSeries : [{ label: "restores" }],
    [xs, ...(mixes.length ? mixes.map((m) => h.map((b) => b.mix[m] || 0)) : [h.map(() => 0)])], mixPlot);
  const lat = [["TTFT p50", "ttft_p50", "#1565c0"], ["TTFT p99", "ttft_p99", "#90caf9"],
    ["TBT p50", "tbt_p50", "#2e7d32"], ["TBT p99", "tbt_p99", "#a5d6a7"], ["restore p50", "restore_p50", "#c62828"]];
  latPlot = chart(document.getElementById("lat"), lat.map(([label, , stroke]) => ({ label, stroke, width: 2 })),
    [xs, ...lat.map(([, key]) => h.map((b) => b[key]))], latPlot);
}

async function poll() {
  try {
    const r = await fetch("/api/dashboard", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    draw(await r.json());
  } catch (e) {
    const st = document.getElementById("status");
    st.textContent = `no data (${e.message})`;
    st.className = "stale";
  }
  setTimeout(poll, 2000);
}

poll();
