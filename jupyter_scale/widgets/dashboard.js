// The %%distribute dashboard: state, progress, the reported scalars per rank (+ their mean)
// on a chart with axes, a legend, a metric choice, log scale, smoothing and a hover read-out,
// the worker table, and the ranks' last lines of output, by rank. The kernel sends every metric's curves; choosing among them, the
// scale and the smoothing happen here (the kernel does not answer while the cell runs).
const SVG = "http://www.w3.org/2000/svg";
const [W, H] = [480, 210];
const PAD = { left: 52, right: 12, top: 10, bottom: 34 };
const SMOOTHING = 0.6; // TensorBoard's default weight for its exponential moving average

// Whole numbers (pids, steps) exactly; measurements to 4 significant digits.
function fmt(x) {
  if (typeof x !== "number") return x ?? "";
  return Number.isInteger(x) ? x.toString() : Number(x.toPrecision(4)).toString();
}

// About `count` round ticks (1, 2 or 5 times a power of ten) covering [lo, hi].
function ticks(lo, hi, count) {
  if (!(hi - lo > 1e-9 * Math.max(Math.abs(lo), Math.abs(hi), 1e-300))) return [lo];
  const raw = (hi - lo) / count, power = 10 ** Math.floor(Math.log10(raw));
  const gap = s => Math.abs(Math.log(s / raw));
  const step = [1, 2, 5, 10].map(m => m * power).reduce((a, b) => (gap(b) < gap(a) ? b : a));
  const out = [];
  // Counted in whole steps (a float added to itself can stop moving), at most 20 of them.
  for (let i = Math.ceil(lo / step); i * step <= hi + step * 1e-9 && out.length < 20; i++) {
    out.push(Number((i * step).toPrecision(12)));
  }
  return out;
}

// Ticks of a log axis over [lo, hi] (in log10 units): powers of ten, with 2 and 5 between
// them when the range spans few decades, round values of the range when it spans less than one.
function logTicks(lo, hi) {
  const out = [];
  for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
    for (const m of hi - lo > 3 ? [1] : [1, 2, 5]) {
      const t = Math.log10(m) + e;
      if (t >= lo - 1e-9 && t <= hi + 1e-9) out.push(t);
    }
  }
  return out.length >= 2 ? out : ticks(10 ** lo, 10 ** hi, 4).filter(v => v > 0).map(Math.log10);
}

// TensorBoard's smoothing: an exponential moving average, debiased at the start.
function smooth(curve) {
  let last = 0, n = 0;
  return curve.map(([s, v]) => {
    last = last * SMOOTHING + (1 - SMOOTHING) * v;
    n += 1;
    return [s, last / (1 - SMOOTHING ** n)];
  });
}

// A rank's colour is its own in every chart (the palette in turn by rank number); the mean is black.
function color(name, colors) {
  return name === "mean" ? "#000" : colors[Number(name) % colors.length];
}

function node(tag, attrs, text) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

// Draws `curves` ({"0": [[step, value], ...], ..., "mean": [...]}); returns what the
// hover read-out needs (the curves as drawn and the x scale), or null when there is nothing.
function chart(svg, curves, metric, colors, opts) {
  svg.replaceChildren();
  let named = Object.entries(curves).map(([name, c]) => [name, c, color(name, colors)]);
  if (opts.log) named = named.map(([n, c, k]) => [n, c.filter(p => p[1] > 0).map(([s, v]) => [s, Math.log10(v)]), k]);
  const pts = named.flatMap(([, c]) => c);
  if (!pts.length) {
    svg.appendChild(node("text", { x: PAD.left, y: H / 2, "font-size": 11 },
      opts.log ? `no positive ${metric} to show on a log scale` : "no points yet"));
    return null;
  }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  // A flat range (every rank reported the same value, a mean a rounding step off it) gets room.
  const flat = (a, b) => !(b - a > 1e-9 * Math.max(Math.abs(a), Math.abs(b), 1e-300));
  if (flat(x0, x1)) x1 = x0 + 1;
  if (flat(y0, y1)) [y0, y1] = [y0 - Math.max(0.5, Math.abs(y0) * 0.1), y1 + Math.max(0.5, Math.abs(y1) * 0.1)];
  const x = s => PAD.left + (s - x0) * (W - PAD.left - PAD.right) / (x1 - x0);
  const y = v => H - PAD.bottom - (v - y0) * (H - PAD.top - PAD.bottom) / (y1 - y0);
  const axes = node("g", { class: "js-axes", "font-size": 10, fill: "currentColor" });
  axes.appendChild(node("line", { x1: PAD.left, x2: W - PAD.right, y1: H - PAD.bottom, y2: H - PAD.bottom, stroke: "#888" }));
  axes.appendChild(node("line", { x1: PAD.left, x2: PAD.left, y1: PAD.top, y2: H - PAD.bottom, stroke: "#888" }));
  for (const t of ticks(x0, x1, 6).filter(t => Number.isInteger(t))) {
    axes.appendChild(node("line", { x1: x(t), x2: x(t), y1: H - PAD.bottom, y2: H - PAD.bottom + 4, stroke: "#888" }));
    axes.appendChild(node("text", { class: "js-xtick", x: x(t), y: H - PAD.bottom + 14, "text-anchor": "middle" }, fmt(t)));
  }
  for (const t of opts.log ? logTicks(y0, y1) : ticks(y0, y1, 5)) {
    axes.appendChild(node("line", { x1: PAD.left - 4, x2: W - PAD.right, y1: y(t), y2: y(t), stroke: "#e4e4e4" }));
    axes.appendChild(node("text", { class: "js-ytick", x: PAD.left - 6, y: y(t) + 3, "text-anchor": "end" },
      fmt(opts.log ? Number((10 ** t).toPrecision(6)) : t)));
  }
  axes.appendChild(node("text", { class: "js-xlabel", x: (PAD.left + W - PAD.right) / 2, y: H - 4, "text-anchor": "middle" }, "step"));
  axes.appendChild(node("text", { class: "js-ylabel", x: 0, y: 0, "text-anchor": "middle",
    transform: `translate(11 ${(PAD.top + H - PAD.bottom) / 2}) rotate(-90)` }, metric + (opts.log ? " (log)" : "")));
  svg.appendChild(axes);
  const drawn = [];
  for (const [name, curve, stroke] of named) {
    const shown = opts.smooth ? smooth(curve) : curve;
    const line = (points, extra) => node("polyline", { fill: "none", "stroke-width": 1.5, stroke, ...extra,
      points: points.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(" ") });
    if (opts.smooth) svg.appendChild(line(curve, { "stroke-opacity": 0.25, "data-raw": name }));
    const drawnLine = line(shown, name === "mean" ? { "stroke-dasharray": "4 3" } : {});
    drawnLine.dataset.series = name === "mean" ? "mean" : `rank ${name}`;
    svg.appendChild(drawnLine);
    drawn.push([drawnLine.dataset.series, shown]);
  }
  return { drawn, step: px => x0 + (px - PAD.left) * (x1 - x0) / (W - PAD.left - PAD.right), x, log: opts.log };
}

// The point of `curve` nearest to `step` (curves are in step order).
function nearest(curve, step) {
  let [lo, hi] = [0, curve.length - 1];
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (curve[mid][0] < step) lo = mid + 1; else hi = mid;
  }
  return lo > 0 && step - curve[lo - 1][0] < curve[lo][0] - step ? curve[lo - 1] : curve[lo];
}

// [0, 1, 2, 5] -> "0-2,5", as the kernel labels lines that several ranks printed alike.
function rankSpan(ranks) {
  const spans = [];
  for (const r of [...ranks].sort((a, b) => a - b)) {
    if (spans.length && r === spans[spans.length - 1][1] + 1) spans[spans.length - 1][1] = r;
    else spans.push([r, r]);
  }
  return spans.map(([a, b]) => (b > a ? `${a}-${b}` : `${a}`)).join(",");
}

function render({ model, el }) {
  el.classList.add("jupyter-scale");
  el.innerHTML = `<div class="js-head"><b>jupyter_scale</b><span class="js-state"></span>
    <span class="js-message"></span></div><div class="js-progress"></div>
    <div class="js-controls"><select class="js-metric" title="the reported scalar to chart"></select>
    <label><input type="checkbox" class="js-log"> log scale</label>
    <label><input type="checkbox" class="js-smooth"> smooth</label></div>
    <svg class="js-chart" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}"></svg>
    <div class="js-legend"></div><div class="js-readout">&nbsp;</div><table class="js-workers"></table>
    <details class="js-output-box"><summary>output (<span class="js-output-count">0 lines</span>)</summary>
    <select class="js-output-rank" title="whose lines to show"></select><pre class="js-output"></pre></details>`;
  const q = s => el.querySelector(s);
  let chosen = "", drawn = null;
  const drawChart = () => {
    const series = model.get("series") || {}, names = model.get("metrics") || Object.keys(series);
    const select = q(".js-metric");
    if (select.options.length !== names.length || [...select.options].some((o, i) => o.value !== names[i])) {
      select.replaceChildren(...names.map(n => Object.assign(document.createElement("option"), { value: n, textContent: n })));
    }
    if (!names.includes(chosen)) chosen = model.get("metric") || names[0] || "";
    select.value = chosen;
    select.hidden = names.length < 2;
    const curves = series[chosen] || {};
    drawn = chart(q(".js-chart"), curves, chosen, model.get("colors"), { log: q(".js-log").checked, smooth: q(".js-smooth").checked });
    showHover();
    const legend = q(".js-legend");
    legend.replaceChildren(...Object.keys(curves).map(name => {
      const item = document.createElement("span");
      item.className = "js-key";
      item.dataset.series = name === "mean" ? "mean" : `rank ${name}`;
      const swatch = document.createElement("i");
      swatch.style.borderTopColor = color(name, model.get("colors"));
      if (name === "mean") swatch.style.borderTopStyle = "dashed";
      item.append(swatch, name === "mean" ? "mean of the ranks" : `rank ${name}`);
      return item;
    }));
  };
  q(".js-metric").addEventListener("change", e => { chosen = e.target.value; drawChart(); });
  q(".js-log").addEventListener("change", drawChart);
  q(".js-smooth").addEventListener("change", drawChart);
  const svg = q(".js-chart");
  let hoverAt = null; // where the mouse is, 0 to 1 across the chart: kept while pushes redraw it
  const showHover = () => {
    svg.querySelector(".js-guide")?.remove();
    const parts = drawn && hoverAt !== null ? drawn.drawn.filter(([, c]) => c.length) : [];
    if (!parts.length) { q(".js-readout").innerHTML = "&nbsp;"; return; }
    const step = drawn.step(hoverAt * W);
    const found = parts.map(([name, c]) => [name, nearest(c, step)]);
    const value = v => fmt(drawn.log ? 10 ** v : v);
    const same = found.every(([, p]) => p[0] === found[0][1][0]);
    q(".js-readout").textContent = same
      ? `step ${fmt(found[0][1][0])}: ` + found.map(([name, p]) => `${name} ${value(p[1])}`).join(" · ")
      : found.map(([name, p]) => `${name} ${value(p[1])} (step ${fmt(p[0])})`).join(" · ");
    const at = nearest(parts[0][1], step)[0];
    svg.appendChild(node("line", { class: "js-guide", x1: drawn.x(at), x2: drawn.x(at), y1: PAD.top, y2: H - PAD.bottom,
      stroke: "#999", "stroke-dasharray": "2 2" }));
  };
  svg.addEventListener("mousemove", e => {
    const box = svg.getBoundingClientRect();
    hoverAt = (e.clientX - box.left) / box.width;
    showHover();
  });
  svg.addEventListener("mouseleave", () => { hoverAt = null; showHover(); });
  const draw = () => {
    const state = model.get("state");
    q(".js-state").textContent = state;
    q(".js-state").dataset.state = state;
    q(".js-message").textContent = model.get("message");
    const p = model.get("progress"), lost = model.get("lost");
    let text = `step ${p.step ?? 0}${p.total ? " / " + p.total : ""}`;
    if (p.epoch !== undefined) text += ` · epoch ${p.epoch}`;
    if (p.rate) text += ` · ${fmt(p.rate)} steps/s`;
    if (p.eta !== undefined) text += ` · ETA ${fmt(p.eta)} s`;
    text += ` · ${fmt(p.elapsed ?? 0)} s`;
    if (lost) text += ` · ${lost} points lost`;
    q(".js-progress").textContent = text;
    const cols = ["rank", "host", "pid", "device", "state", "last_step", "steps_per_s", "memory"];
    const head = "<tr>" + ["rank", "host", "pid", "device", "state", "last step", "steps/s", "memory"]
      .map(c => `<th>${c}</th>`).join("") + "</tr>";
    const table = q(".js-workers");
    table.innerHTML = head;
    for (const row of model.get("workers")) {
      const tr = document.createElement("tr");
      tr.dataset.rank = row.rank;
      for (const c of cols) { const td = document.createElement("td"); td.textContent = fmt(row[c]); tr.appendChild(td); }
      table.appendChild(tr);
    }
  };
  let shownRank = "all";
  const drawOutput = () => {
    const select = q(".js-output-rank");
    const choices = ["all", ...(model.get("workers") || []).map(row => String(row.rank))];
    if (select.options.length !== choices.length) {
      select.replaceChildren(...choices.map(c => Object.assign(document.createElement("option"),
        { value: c, textContent: c === "all" ? "all ranks" : `rank ${c}` })));
    }
    select.value = shownRank;
    const lines = (model.get("output") || [])
      .filter(([ranks]) => shownRank === "all" || ranks.includes(Number(shownRank)));
    q(".js-output").replaceChildren(...lines.map(([ranks, stream, text]) => {
      const line = document.createElement("div");
      line.className = stream === "stderr" ? "js-line js-stderr" : "js-line";
      line.dataset.ranks = ranks.join(",");
      line.textContent = `[rank ${rankSpan(ranks)}] ${text}`;
      return line;
    }));
    q(".js-output-count").textContent = `${lines.length} line${lines.length === 1 ? "" : "s"}`;
  };
  q(".js-output-rank").addEventListener("change", e => { shownRank = e.target.value; drawOutput(); });
  for (const name of ["output", "workers"]) model.on(`change:${name}`, drawOutput);
  for (const name of ["state", "message", "progress", "workers", "lost"]) model.on(`change:${name}`, draw);
  for (const name of ["series", "metrics", "metric"]) model.on(`change:${name}`, drawChart);
  draw();
  drawChart();
  drawOutput();
}

export default { render };
