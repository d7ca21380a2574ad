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
    this._render();
  }

  private _render(): void {
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

  private _chart(job: IJob): Element {
    const ns = 'http://www.w3.org/2000/svg';
    const width = 240, height = 100, pad = 6;
    const svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('class', 'jp-ScalePanel-chart');
    svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
    const series = Object.entries(job.series);
    const points = series.flatMap(([, curve]) => curve);
    if (!points.length) {
      return svg;
    }
    const xs = points.map(q => q[0]), ys = points.map(q => q[1]);
    const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    const sx = (width - 2 * pad) / (x1 - x0 || 1), sy = (height - 2 * pad) / (y1 - y0 || 1);
    series.forEach(([name, curve], i) => {
      const line = document.createElementNS(ns, 'polyline');
      line.setAttribute('data-series', name === 'mean' ? 'mean' : `rank ${name}`);
      line.setAttribute('fill', 'none');
      const colors = job.colors ?? []; // an older kernel sends none
      const stroke = colors.length ? colors[i % colors.length] : 'var(--jp-ui-font-color2)';
      line.setAttribute('stroke', name === 'mean' ? 'var(--jp-ui-font-color1)' : stroke);
      line.setAttribute('stroke-width', '1.5');
      if (name === 'mean') {
        line.setAttribute('stroke-dasharray', '4 3');
      }
      line.setAttribute('points',
        curve.map(([s, v]) => `${(pad + (s - x0) * sx).toFixed(1)},${(height - pad - (v - y0) * sy).toFixed(1)}`).join(' '));
      svg.appendChild(line);
    });
    const label = document.createElementNS(ns, 'title');
    label.textContent = `${job.metric}: ${y0.toPrecision(4)} to ${y1.toPrecision(4)}`;
    svg.appendChild(label);
    return svg;
  }
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
