/**
 * The Scale sidebar: the active notebook's cluster, one row per rank, the running job
 * with its progress and a small live loss chart, and the actions.
 */
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { IJob, IRank, IScaleState, ScaleConnection } from './connection';

export const scaleIcon = new LabIcon({
  name: 'jupyter-scale:icon',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><g class="jp-icon3" fill="#616161">' +
    '<rect x="2" y="14" width="5" height="8" rx="1"/><rect x="9.5" y="8" width="5" height="14" rx="1"/>' +
    '<rect x="17" y="2" width="5" height="20" rx="1"/></g></svg>'
});


function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: { [key: string]: string } = {},
  ...children: (Node | string)[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    node.setAttribute(key, value);
  }
  node.append(...children);
  return node;
}

export class ScalePanel extends Widget {
  constructor(private readonly _connection: ScaleConnection) {
    super();
    this.id = 'jupyter-scale-sidebar';
    this.addClass('jp-ScalePanel');
    this.title.icon = scaleIcon;
    this.title.caption = 'Scale: distributed training cluster';
    _connection.changed.connect(this._render, this);
    // A state that came while the user was choosing (a menu open, a number being typed) is
    // shown when they are done: redrawing would close the menu or drop the typing.
    this.node.addEventListener('focusout', () => {
      if (this._deferred) {
        setTimeout(() => this._render());
      }
    });
    this._render();
  }

  private _render(): void {
    const active = document.activeElement;
    if ((active instanceof HTMLSelectElement || (active instanceof HTMLInputElement && active.type !== 'checkbox')) &&
        this.node.contains(active)) {
      this._deferred = true;
      return;
    }
    this._deferred = false;
    const c = this._connection;
    const body: Node[] = [el('h2', { class: 'jp-ScalePanel-title' }, 'Scale')];
    if (c.link === 'no-notebook') {
      body.push(el('p', { class: 'jp-ScalePanel-hint' }, 'Open a notebook to see its cluster.'));
    } else if (c.link === 'no-kernel') {
      body.push(el('p', { class: 'jp-ScalePanel-hint' }, `${c.notebookName}: no kernel.`));
    } else if (c.link === 'not-loaded' || !c.state) {
      body.push(
        el('p', { class: 'jp-ScalePanel-hint', 'data-link': 'not-loaded' },
          `${c.notebookName}: run `, el('code', {}, '%load_ext jupyter_scale'), ' in the notebook.')
      );
    } else {
      body.push(el('div', { class: 'jp-ScalePanel-notebook' }, c.notebookName));
      body.push(this._cluster(c.state), this._ranks(c.state.ranks), this._job(c.state.job));
    }
    if (c.error) {
      body.push(el('p', { class: 'jp-ScalePanel-error' }, c.error));
    }
    this.node.replaceChildren(...body);
  }

  private _button(action: string, label: string, onClick: () => void, enabled = true): HTMLButtonElement {
    const button = el('button', { class: 'jp-mod-styled jp-ScalePanel-button', 'data-action': action }, label);
    button.disabled = !enabled;
    button.onclick = onClick;
    return button;
  }

  private _cluster(state: IScaleState): HTMLElement {
    const cluster = state.cluster;
    const busy = state.job?.status === 'running';
    const size = el('input', {
      class: 'jp-ScalePanel-size', type: 'number', min: '1', step: '1',
      value: String(cluster.workers || 2), 'aria-label': 'workers'
    });
    const workers = () => Math.max(1, parseInt(size.value, 10) || 1);
    const summary = cluster.running
      ? `${cluster.engine} · ${cluster.workers} workers${cluster.connected ? ' (connected)' : ''}`
      : `${cluster.engine} · no cluster running`;
    const addresses = Object.entries(cluster.addresses).map(([key, value]) =>
      el('div', { class: 'jp-ScalePanel-address' }, `${key}: ${value}`)
    );
    const actions = el('div', { class: 'jp-ScalePanel-actions' },
      size,
      cluster.running
        ? this._button('resize', 'Resize', () => this._connection.send('resize', workers()), !busy)
        : this._button('start', 'Start', () => this._connection.send('start', workers())),
      this._button('restart', 'Restart', () => this._connection.send('restart'), cluster.running && !busy),
      this._button('stop', 'Stop', () => this._connection.send('stop'), cluster.running && !busy)
    );
    return el('section', { class: 'jp-ScalePanel-cluster', 'data-running': String(cluster.running) },
      el('h3', {}, 'Cluster'), el('div', { class: 'jp-ScalePanel-summary' }, summary), ...addresses, actions);
  }

  private _ranks(ranks: IRank[]): HTMLElement {
    // Narrow enough for the sidebar: the host and the device go into the heading when every
    // rank shares them, else into columns of their own.
    const shared = (key: 'host' | 'device') => {
      const values = [...new Set(ranks.map(r => r[key] ?? ''))];
      return values.length === 1 ? values[0] : null;
    };
    const host = shared('host'), device = shared('device');
    const columns: [string, (r: IRank) => string][] = [
      ['rank', r => String(r.rank)],
      ['state', r => (r.collective ? `in ${r.collective} ${r.waiting_s ?? 0}s` : r.state)],
      ['pid', r => String(r.pid ?? '')]
    ];
    if (host === null) {
      columns.push(['host', r => r.host ?? '']);
    }
    if (device === null) {
      columns.push(['device', r => r.device ?? '']);
    }
    columns.push(['mem', r => r.memory ?? ''], ['step', r => (r.last_step === undefined ? '' : String(r.last_step + 1))]);
    const head = el('tr', {}, ...columns.map(([name]) => el('th', {}, name)));
    const rows = ranks.map(r =>
      el('tr', { 'data-rank': String(r.rank), 'data-state': r.state, 'data-host': r.host ?? '' },
        ...columns.map(([name, value]) => el('td', { 'data-column': name }, value(r))))
    );
    const where = [host, device].filter(v => v).join(' · ');
    return el('section', { class: 'jp-ScalePanel-ranks' },
      el('h3', {}, `Ranks (${ranks.length})${where ? ` on ${where}` : ''}`),
      el('table', {}, el('thead', {}, head), el('tbody', {}, ...rows)));
  }

  private _job(job: IJob | null): HTMLElement {
    const section = el('section', { class: 'jp-ScalePanel-job' }, el('h3', {}, 'Job'));
    if (!job) {
      section.append(el('p', { class: 'jp-ScalePanel-hint' }, 'No %%distribute cell has run yet.'));
      return section;
    }
    const p = job.progress;
    const percent = job.fraction === null ? null : Math.round(job.fraction * 100);
    const detail = [`step ${p.step}${p.total ? ` / ${p.total}` : ''}`];
    if (p.rate) {
      detail.push(`${p.rate} steps/s`);
    }
    if (p.eta !== undefined && job.status === 'running') {
      detail.push(`ETA ${p.eta} s`);
    }
    const bar = el('div', { class: 'jp-ScalePanel-bar' },
      el('div', { class: 'jp-ScalePanel-barFill', style: `width: ${percent ?? (job.status === 'running' ? 0 : 100)}%` }));
    section.append(
      el('div', { class: 'jp-ScalePanel-jobState', 'data-state': job.status },
        `#${job.index} ${job.status}${percent === null ? '' : ` · ${percent}%`}`),
      bar,
      el('div', { class: 'jp-ScalePanel-detail' }, detail.join(' · ')),
      this._chart(job)
    );
    if (job.error) {
      section.append(el('div', { class: 'jp-ScalePanel-error' }, job.error));
    }
    if (job.status === 'running') {
      section.append(this._button('interrupt', 'Interrupt', () => void this._connection.interrupt()));
    }
    return section;
  }

  private _chart(job: IJob): HTMLElement {
    const names = job.metrics ?? [job.metric];
    // The user's choice while the job has it (a new run may not have reported it yet).
    const metric = names.includes(this._metric) ? this._metric : job.metric;
    const controls = el('div', { class: 'jp-ScalePanel-chartControls' });
    if (names.length > 1) {
      const select = el('select', { class: 'jp-ScalePanel-metric', 'aria-label': 'metric' },
        ...names.map(n => el('option', { value: n }, n)));
      select.value = metric;
      select.onchange = () => {
        this._metric = select.value;
        select.blur();
        this._render();
      };
      controls.append(select);
    }
    const toggle = (cls: string, label: string, on: boolean, set: (on: boolean) => void) => {
      const box = el('input', { type: 'checkbox', class: cls });
      box.checked = on;
      box.onchange = () => {
        set(box.checked);
        this._render();
      };
      return el('label', {}, box, ` ${label}`);
    };
    controls.append(
      toggle('jp-ScalePanel-log', 'log scale', this._log, on => (this._log = on)),
      toggle('jp-ScalePanel-smooth', 'smooth', this._smooth, on => (this._smooth = on)));
    const curves = job.series[metric] ?? {};
    const colors = job.colors ?? []; // an older kernel sends none
    // A rank's colour is its own in every chart (the palette in turn by rank number).
    const color = (name: string) =>
      name === 'mean' ? 'var(--jp-ui-font-color1)' : colors.length ? colors[Number(name) % colors.length] : 'var(--jp-ui-font-color2)';
    const legend = el('div', { class: 'jp-ScalePanel-legend' },
      ...Object.keys(curves).map(name => {
        const swatch = el('i', { style: `border-top: 2px ${name === 'mean' ? 'dashed' : 'solid'} ${color(name)}` });
        return el('span', { class: 'jp-ScalePanel-key', 'data-series': name === 'mean' ? 'mean' : `rank ${name}` },
          swatch, name === 'mean' ? 'mean' : `rank ${name}`);
      }));
    const readout = el('div', { class: 'jp-ScalePanel-readout' });
    const chart = plot(curves, metric, { log: this._log, smooth: this._smooth }, color);
    // The values at the step under the mouse; kept while new states redraw the chart.
    const show = () => {
      const said = this._hover === null ? '' : chart.readout(this._hover);
      readout.textContent = said || '\u00a0';
    };
    chart.svg.addEventListener('mousemove', e => {
      const box = chart.svg.getBoundingClientRect();
      this._hover = (e.clientX - box.left) / box.width;
      show();
    });
    chart.svg.addEventListener('mouseleave', () => {
      this._hover = null;
      show();
    });
    show();
    return el('div', {}, controls, chart.svg, legend, readout);
  }

  private _metric = ''; // the metric the user chose (kept across states and runs)
  private _deferred = false; // a state came while the user was choosing
  private _log = false;
  private _smooth = false;
  private _hover: number | null = null; // where the mouse is over the chart, 0 to 1 across
}

// About `count` round ticks (1, 2 or 5 times a power of ten) covering [lo, hi].
function ticks(lo: number, hi: number, count: number): number[] {
  if (flat(lo, hi)) {
    return [lo];
  }
  const raw = (hi - lo) / count, power = 10 ** Math.floor(Math.log10(raw));
  const gap = (s: number) => Math.abs(Math.log(s / raw));
  const step = [1, 2, 5, 10].map(m => m * power).reduce((a, b) => (gap(b) < gap(a) ? b : a));
  const out: number[] = [];
  // Counted in whole steps (a float added to itself can stop moving), at most 20 of them.
  for (let i = Math.ceil(lo / step); i * step <= hi + step * 1e-9 && out.length < 20; i++) {
    out.push(Number((i * step).toPrecision(12)));
  }
  return out;
}

// Equal but for rounding (every rank reported the same value; their mean a rounding step off).
function flat(a: number, b: number): boolean {
  return !(b - a > 1e-9 * Math.max(Math.abs(a), Math.abs(b), 1e-300));
}

// Ticks of a log axis over [lo, hi] (log10 units): powers of ten, with 2 and 5 between them
// over few decades, round values of the range when it spans less than one (as the dashboard's).
function logTicks(lo: number, hi: number): number[] {
  const out: number[] = [];
  for (let e = Math.floor(lo); e <= Math.ceil(hi); e++) {
    for (const m of hi - lo > 3 ? [1] : [1, 2, 5]) {
      const t = Math.log10(m) + e;
      if (t >= lo - 1e-9 && t <= hi + 1e-9) {
        out.push(t);
      }
    }
  }
  return out.length >= 2 ? out : ticks(10 ** lo, 10 ** hi, 4).filter(v => v > 0).map(Math.log10);
}

function fmt(x: number): string {
  return Number.isInteger(x) ? String(x) : String(Number(x.toPrecision(3)));
}

// TensorBoard's smoothing (as the dashboard's): an exponential moving average, debiased.
function smoothed(curve: number[][], weight = 0.6): number[][] {
  let last = 0;
  return curve.map(([s, v], n) => {
    last = last * weight + (1 - weight) * v;
    return [s, last / (1 - weight ** (n + 1))];
  });
}

/** The point of `curve` (in step order) nearest to `step`. */
function nearest(curve: number[][], step: number): number[] {
  let [lo, hi] = [0, curve.length - 1];
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (curve[mid][0] < step) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo > 0 && step - curve[lo - 1][0] < curve[lo][0] - step ? curve[lo - 1] : curve[lo];
}

interface IPlot {
  svg: SVGElement;
  /** The values at `at` (0 to 1 across the chart): "step 12: rank 0 0.43 · ..." */
  readout(at: number): string;
}

/** The curves of `metric` with axes: steps across, values (or their log) up. */
function plot(curves: { [name: string]: number[][] }, metric: string, opts: { log: boolean; smooth: boolean },
  color: (name: string) => string): IPlot {
  const ns = 'http://www.w3.org/2000/svg';
  const [width, height] = [260, 130];
  const pad = { left: 40, right: 6, top: 6, bottom: 26 };
  const log = opts.log;
  const node = (tag: string, attrs: { [key: string]: string | number }, text?: string) => {
    const n = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) {
      n.setAttribute(k, String(v));
    }
    if (text !== undefined) {
      n.textContent = text;
    }
    return n;
  };
  const svg = node('svg', { class: 'jp-ScalePanel-chart', viewBox: `0 0 ${width} ${height}` }) as SVGElement;
  const named = Object.entries(curves).map(([name, curve]): [string, number[][], string] => [
    name, log ? curve.filter(p => p[1] > 0).map(([s, v]) => [s, Math.log10(v)]) : curve, color(name)]);
  const points = named.flatMap(([, curve]) => curve);
  if (!points.length) {
    return { svg, readout: () => '' };
  }
  const xs = points.map(q => q[0]), ys = points.map(q => q[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (flat(x0, x1)) {
    x1 = x0 + 1;
  }
  if (flat(y0, y1)) {
    [y0, y1] = [y0 - Math.max(0.5, Math.abs(y0) * 0.1), y1 + Math.max(0.5, Math.abs(y1) * 0.1)];
  }
  const x = (s: number) => pad.left + (s - x0) * (width - pad.left - pad.right) / (x1 - x0);
  const y = (v: number) => height - pad.bottom - (v - y0) * (height - pad.top - pad.bottom) / (y1 - y0);
  const axes = node('g', { class: 'jp-ScalePanel-axes', 'font-size': 9, fill: 'var(--jp-ui-font-color2)' });
  axes.append(
    node('line', { x1: pad.left, x2: width - pad.right, y1: height - pad.bottom, y2: height - pad.bottom, stroke: 'var(--jp-border-color1)' }),
    node('line', { x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, stroke: 'var(--jp-border-color1)' }));
  for (const t of ticks(x0, x1, 4).filter(t => Number.isInteger(t))) {
    axes.append(node('text', { class: 'jp-ScalePanel-xtick', x: x(t), y: height - pad.bottom + 10, 'text-anchor': 'middle' }, fmt(t)));
  }
  for (const t of log ? logTicks(y0, y1).filter((_, i, all) => all.length <= 6 || i % 2 === 0) : ticks(y0, y1, 4)) {
    axes.append(node('text', { class: 'jp-ScalePanel-ytick', x: pad.left - 3, y: y(t) + 3, 'text-anchor': 'end' },
      fmt(log ? Number((10 ** t).toPrecision(3)) : t)));
  }
  axes.append(
    node('text', { class: 'jp-ScalePanel-xlabel', x: (pad.left + width - pad.right) / 2, y: height - 2, 'text-anchor': 'middle' }, 'step'),
    node('text', { class: 'jp-ScalePanel-ylabel', x: 0, y: 0, 'text-anchor': 'middle',
      transform: `translate(8 ${(pad.top + height - pad.bottom) / 2}) rotate(-90)` }, metric + (log ? ' (log)' : '')));
  svg.append(axes);
  const drawn: [string, number[][]][] = [];
  for (const [name, curve, stroke] of named) {
    const label = name === 'mean' ? 'mean' : `rank ${name}`;
    const line = (pts: number[][]) => node('polyline', { fill: 'none', stroke, 'stroke-width': 1.5,
      points: pts.map(([s, v]) => `${x(s).toFixed(1)},${y(v).toFixed(1)}`).join(' ') });
    const shown = opts.smooth ? smoothed(curve) : curve;
    if (opts.smooth) {
      const raw = line(curve);
      raw.setAttribute('stroke-opacity', '0.25');
      raw.setAttribute('data-raw', label);
      svg.append(raw);
    }
    const main = line(shown);
    main.setAttribute('data-series', label);
    if (name === 'mean') {
      main.setAttribute('stroke-dasharray', '4 3');
    }
    svg.append(main);
    if (shown.length) {
      drawn.push([label, shown]);
    }
  }
  const readout = (at: number): string => {
    if (!drawn.length) {
      return '';
    }
    const step = x0 + (at * width - pad.left) * (x1 - x0) / (width - pad.left - pad.right);
    const found = drawn.map(([label, curve]): [string, number[]] => [label, nearest(curve, step)]);
    const value = (v: number) => fmt(log ? Number((10 ** v).toPrecision(4)) : v);
    return `step ${found[0][1][0]}: ` + found.map(([label, p]) => `${label} ${value(p[1])}`).join(' · ');
  };
  return { svg, readout };
}

/** The status-bar item, e.g. `Scale: 2 workers · running 45%`. */
export class ScaleStatus extends Widget {
  constructor(private readonly _connection: ScaleConnection) {
    super();
    this.addClass('jp-ScaleStatus');
    _connection.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const state = this._connection.state;
    let text = '';
    if (state) {
      text = state.cluster.running ? `Scale: ${state.cluster.workers} workers` : 'Scale: no cluster';
      const job = state.job;
      if (job && job.status === 'running') {
        text += ` · running${job.fraction === null ? ` step ${job.progress.step}` : ` ${Math.round(job.fraction * 100)}%`}`;
      } else if (job && state.cluster.running) {
        text += ` · ${job.status}`;
      }
    }
    this.node.textContent = text;
    this.setHidden(!text);
  }
}
