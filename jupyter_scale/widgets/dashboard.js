// The %%distribute dashboard: state, progress, a loss curve per rank (+ mean), worker table.
const SVG = "http://www.w3.org/2000/svg";

// Whole numbers (pids, steps) exactly; measurements to 4 significant digits.
function fmt(x) {
  if (typeof x !== "number") return x ?? "";
  return Number.isInteger(x) ? x.toString() : Number(x.toPrecision(4)).toString();
}

function chart(svg, series, metric, colors) {
  svg.replaceChildren();
  const [w, h, pad] = [420, 160, 28];
  const pts = Object.values(series).flat();
  if (!pts.length) return;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (w - 2 * pad) / ((x1 - x0) || 1), sy = (h - 2 * pad) / ((y1 - y0) || 1);
  Object.entries(series).forEach(([name, curve], i) => {
    const line = document.createElementNS(SVG, "polyline");
    line.setAttribute("fill", "none");
    line.setAttribute("stroke-width", "1.5");
    line.setAttribute("stroke", name === "mean" ? "#000" : colors[i % colors.length]);
    if (name === "mean") line.setAttribute("stroke-dasharray", "4 3");
    line.dataset.series = name === "mean" ? "mean" : `rank ${name}`;
    line.setAttribute("points", curve.map(([s, v]) =>
      `${(pad + (s - x0) * sx).toFixed(1)},${(h - pad - (v - y0) * sy).toFixed(1)}`).join(" "));
    svg.appendChild(line);
  });
  const label = document.createElementNS(SVG, "text");
  label.setAttribute("x", pad); label.setAttribute("y", 14); label.setAttribute("font-size", 11);
  label.textContent = `${metric} (${fmt(y0)} to ${fmt(y1)}), steps ${x0} to ${x1}`;
  svg.appendChild(label);
}

function render({ model, el }) {
  el.classList.add("jupyter-scale");
  el.innerHTML = `<div class="js-head"><b>jupyter_scale</b><span class="js-state"></span>
    <span class="js-message"></span></div><div class="js-progress"></div>
    <svg class="js-chart" width="420" height="160"></svg><table class="js-workers"></table>`;
  const q = s => el.querySelector(s);
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
    chart(q(".js-chart"), model.get("series"), model.get("metric"), model.get("colors"));
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
  for (const name of ["state", "message", "progress", "series", "workers", "lost", "metric"]) {
    model.on(`change:${name}`, draw);
  }
  draw();
}

export default { render };
