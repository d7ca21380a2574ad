/**
 * The sidebar's link to the active notebook's kernel: a comm on the target
 * `jupyter_scale`, which `%load_ext jupyter_scale` registers in the kernel.
 *
 * The sidebar opens the comm when it attaches to a kernel (so it re-attaches after a
 * page reload or when the notebook is reopened), and again where the extension may have
 * been loaded since: when the reply to a cell carries the payload `%load_ext jupyter_scale`
 * writes, when the kernel is idle after any client ran code naming jupyter_scale (a console
 * on the same kernel gets that reply, not this page), and when it is idle after a restart
 * (the extension loaded by the kernel's configuration). The kernel never opens one itself:
 * frontends without this extension would log "No handler found for comm target".
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const COMM_TARGET = 'jupyter_scale';

// What the kernel sends (jupyter_scale/sidebar.py declares the same shapes as TypedDicts;
// tests/test_sidebar.py checks that the two agree, key by key).
export interface IRank {
  rank: number;
  state: string; // idle, starting, running, in collective, finished, failed, stopped, dead
  pid: number | null;
  host: string | null;
  device: string;
  memory?: string;
  last_step?: number;
  steps_per_s?: number;
  epoch?: number;
  collective?: string;
  waiting_s?: number;
}

export interface IProgress {
  step: number;
  rate: number;
  elapsed: number;
  total?: number;
  eta?: number;
  epoch?: number;
}

export interface IJob {
  index: number;
  status: string; // running, finished, failed, interrupted, timed out
  error: string;
  workers: number;
  metric: string; // the one charted first (the first reported)
  metrics: string[]; // every reported name, in the order first seen
  series: { [metric: string]: { [name: string]: number[][] } };
  colors: string[]; // the ranks' curves in turn
  progress: IProgress;
  fraction: number | null;
}

export interface ICluster {
  running: boolean;
  engine: string;
  workers: number;
  connected: boolean;
  addresses: { [key: string]: string };
  group: { [key: string]: unknown }; // the process group: backend, master_addr, master_port, ready
}

export interface IScaleState {
  type: string;
  version: string;
  cluster: ICluster;
  ranks: IRank[];
  job: IJob | null;
}

/** Where the sidebar stands with the current notebook. */
export type Link = 'no-notebook' | 'no-kernel' | 'not-loaded' | 'attached';

/** Whether `msg` is the reply to a cell that ran `%load_ext jupyter_scale`. */
function loadedBy(msg: KernelMessage.IMessage): boolean {
  if (msg.header.msg_type !== 'execute_reply') {
    return false;
  }
  const payload = (msg.content as { payload?: { source?: string }[] }).payload ?? [];
  return payload.some(item => item.source === COMM_TARGET);
}

/** Whether `msg` is code run by any client of the kernel that names jupyter_scale. */
function mentionsUs(msg: KernelMessage.IMessage): boolean {
  return (
    msg.header.msg_type === 'execute_input' &&
    String((msg.content as { code?: string }).code ?? '').includes(COMM_TARGET)
  );
}

export class ScaleConnection {
  constructor(private readonly _tracker: INotebookTracker) {
    _tracker.currentChanged.connect(this._onNotebook, this);
    this._onNotebook();
  }

  get changed(): ISignal<this, void> {
    return this._changed;
  }
  get link(): Link {
    return this._link;
  }
  get state(): IScaleState | null {
    return this._state;
  }
  get error(): string {
    return this._error;
  }
  get notebookName(): string {
    return this._panel?.title.label ?? '';
  }

  /** Ask the kernel to act on its cluster (runs between cells). */
  send(action: string, workers?: number): void {
    this._error = '';
    if (!this._comm || this._comm.isDisposed) {
      this._error = 'jupyter_scale is not loaded in this kernel';
      this._changed.emit();
      return;
    }
    this._comm.send(workers === undefined ? { action } : { action, workers });
  }

  /** Stop the running job: the kernel's interrupt, which %%distribute passes to every rank. */
  async interrupt(): Promise<void> {
    await this._panel?.sessionContext.session?.kernel?.interrupt();
  }

  private _onNotebook(): void {
    if (this._panel) {
      this._panel.sessionContext.kernelChanged.disconnect(this._onKernel, this);
      this._panel.sessionContext.statusChanged.disconnect(this._onStatus, this);
    }
    this._panel = this._tracker.currentWidget;
    if (this._panel) {
      this._panel.sessionContext.kernelChanged.connect(this._onKernel, this);
      this._panel.sessionContext.statusChanged.connect(this._onStatus, this);
    }
    this._onKernel();
  }

  private _onStatus(context: ISessionContext, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      this._detach('not-loaded');
      this._retry = true;
    } else if (status === 'idle' && this._retry && this._link === 'not-loaded') {
      this._retry = false;
      const kernel = context.session?.kernel;
      if (kernel) {
        this._open(kernel);
      }
    }
  }

  private _onKernel(): void {
    this._detach(this._panel ? 'no-kernel' : 'no-notebook');
    this._retry = false;
    const kernel = this._panel?.sessionContext.session?.kernel;
    if (!kernel) {
      return;
    }
    if (!this._registered.has(kernel)) {
      this._registered.add(kernel);
      kernel.anyMessage.connect((_, args) => {
        if (
          args.direction !== 'recv' ||
          this._panel?.sessionContext.session?.kernel !== kernel ||
          this._link === 'attached'
        ) {
          return;
        }
        if (loadedBy(args.msg)) {
          this._open(kernel);
        } else if (mentionsUs(args.msg)) {
          this._retry = true; // opened when the kernel is idle again
        }
      });
    }
    this._link = 'not-loaded';
    this._changed.emit();
    // Attach to a kernel that already loaded jupyter_scale; if it has not, the kernel closes
    // the comm, and the reply to the %load_ext cell says when to open it again.
    this._open(kernel);
  }

  private _open(kernel: Kernel.IKernelConnection): void {
    if (this._comm && !this._comm.isDisposed && this._link !== 'attached') {
      return; // one is being opened: its state, or its close, answers
    }
    const comm = kernel.createComm(COMM_TARGET);
    this._adopt(comm);
    comm.open({}).done.catch(() => undefined);
  }

  private _adopt(comm: Kernel.IComm): void {
    if (this._comm && this._comm !== comm && !this._comm.isDisposed) {
      this._comm.close();
    }
    this._comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._receive(comm, msg.content.data);
    comm.onClose = () => {
      if (this._comm === comm) {
        this._comm = null;
        this._state = null;
        this._link = this._panel?.sessionContext.session?.kernel ? 'not-loaded' : 'no-kernel';
        this._changed.emit();
      }
    };
  }

  private _receive(comm: Kernel.IComm, data: any): void {
    if (comm !== this._comm || !data) {
      return;
    }
    if (data.type === 'state') {
      this._state = data as IScaleState;
      this._link = 'attached';
    } else if (data.type === 'error') {
      this._error = String(data.message);
    }
    this._changed.emit();
  }

  private _detach(link: Link): void {
    if (this._comm && !this._comm.isDisposed) {
      try {
        this._comm.close();
      } catch {
        // the kernel is gone already
      }
    }
    this._comm = null;
    this._state = null;
    this._error = '';
    this._link = link;
    this._changed.emit();
  }

  private _panel: NotebookPanel | null = null;
  private _comm: Kernel.IComm | null = null;
  private _state: IScaleState | null = null;
  private _error = '';
  private _link: Link = 'no-notebook';
  private _registered = new WeakSet<Kernel.IKernelConnection>();
  private _retry = false; // open the comm when the kernel is next idle
  private _changed = new Signal<this, void>(this);
}
