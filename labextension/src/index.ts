import { ILabShell, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { ScaleConnection } from './connection';
import { ScalePanel, ScaleStatus } from './panel';

/** The Scale sidebar and status-bar item for the active notebook's jupyter_scale cluster. */
const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-scale:sidebar',
  description: 'Shows the cluster, ranks and running job of %%distribute cells.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null
  ) => {
    const connection = new ScaleConnection(tracker);
    const panel = new ScalePanel(connection);
    app.shell.add(panel, 'right', { rank: 600 });
    if (statusBar) {
      statusBar.registerStatusItem('jupyter-scale:status', {
        item: new ScaleStatus(connection),
        align: 'left',
        rank: 4,
        isActive: () => connection.state !== null,
        activeStateChanged: connection.changed
      });
    }
  }
};

export default plugin;
