"""The session's settings: every `%config ScaleSession.<name>` a user can set, with its help.

`ScaleSession` inherits them; traitlets reads `c.ScaleSession.<name>` for them (a class's
configuration applies to what it inherits), so a user sets defaults once in an IPython
profile. The cluster reads the engine's, the launcher's and the timeouts from here too.
"""

from __future__ import annotations

import os

from traitlets import Bool, Float, Integer, List, Unicode, default
from traitlets.config import LoggingConfigurable


class SessionSettings(LoggingConfigurable):
    """What `%%distribute` and `%scale` do by default, and how long they wait."""

    backend_name = Unicode(config=True,
                           help="Cluster engine for the embedded cluster: 'ipyparallel' or 'dask' (any "
                                "engine in the `jupyter_scale.backends` entry-point group). Default: "
                                "$JUPYTER_SCALE_BACKEND, else ipyparallel.")
    launcher = Unicode("local", config=True,
                       help="Where a started cluster's workers run: 'local' (this machine), 'slurm' (a Slurm job; "
                            "options in c.SlurmLauncher) or 'mpi' (one mpiexec, ipyparallel; c.MPILauncher).")
    default_workers = Integer(2, config=True,
                              help="Workers to start when %%distribute has no --workers and no cluster runs.")
    start_timeout = Float(120.0, config=True,
                          help="Seconds to wait for workers to start and to form the process group.")
    call_timeout = Float(120.0, config=True,
                         help="Seconds to wait for the workers' answer to a call that is not a cell: gather(), "
                              "a chunk of a sharded model's pull-back, the end-of-cell buffer sync, cleaning "
                              "the workers of a cluster attached to.")
    stop_timeout = Float(5.0, config=True,
                         help="Seconds %scale stop (and a restart) gives the workers to leave the group, and the "
                              "processes that cells started on them to end, before they are killed.")
    abort_grace = Float(1.0, config=True,
                        help="After one rank fails, seconds to let the others fail on their own "
                             "(a torn-down process group unblocks them) before interrupting them.")
    stop_deadline = Float(15.0, config=True,
                          help="Seconds interrupted ranks get to stop before the cell gives up on them.")
    allow_unauthenticated_servers = Bool(False, config=True,
                                         help="Let TensorFlow and PaddlePaddle cells form their own process groups: "
                                              "TensorFlow's server runs any graph anyone sends it, PaddlePaddle's "
                                              "store serves anyone; both listen on every interface. Only where "
                                              "every user of these machines and every host that reaches them "
                                              "is trusted (see README, Frameworks).")
    display = Unicode("auto", config=True,
                      help="How a running cell shows its progress: 'widget' (the live dashboard), "
                           "'text' (a line every few seconds), or 'auto': the widget in a kernel "
                           "that a Jupyter server or VS Code started, text elsewhere (nbval, terminals).")
    progress_interval = Float(2.0, config=True,
                              help="Seconds between the plain-text progress lines of a running cell.")
    heartbeat_interval = Float(5.0, config=True,
                               help="Seconds between the heartbeats each rank sends while a cell runs.")
    silence_limit = Float(20.0, config=True,
                          help="Seconds a running rank may go without a word (it sends a heartbeat every "
                               "heartbeat_interval s) before the cell counts its worker as lost: its host left "
                               "the network, or the process hangs holding the GIL. 0 turns it off.")
    hang_warning = Float(60.0, config=True,
                         help="Without --timeout there is no time limit; instead, when some ranks have "
                              "waited this many seconds in a collective that others are not in, say which "
                              "rank they wait for (again every as many seconds). 0 turns it off.")
    average_during_backward = Bool(False, config=True,
                                   help="Automatic mode: once every rank has called backward() once per step of "
                                        "the cell's optimizer, average the gradients in buckets during backward(), "
                                        "overlapping communication with it, with DDP's rules: every rank must then "
                                        "call backward() alike, and what the cell does to the gradients after "
                                        "backward() acts on averaged ones. Faster where communication matters (a "
                                        "model of tens of MB or more). False averages them at each step.")
    log_to = List(Unicode(), config=True,
                  help="Where every %%distribute cell's report() points also go, as --log-to: "
                       "'tensorboard[:DIR]' (default DIR: runs), 'mlflow[:TRACKING_URI]'. A cell's own "
                       "--log-to replaces these.")
    log_as = Unicode("ranks", config=True,
                     help="What --log-to writes: 'ranks' (each rank's points) or 'mean' (the mean over the "
                          "ranks at each step)")
    shared_memory_enabled = Bool(True, config=True,
                                 help="When every worker runs on this machine and reads the kernel's shared "
                                      "memory (the embedded cluster), send values' pieces of 1 MB or more through "
                                      "it rather than in the engine's messages (several times faster).")
    shared_memory_keep = Integer(1 << 30, config=True,
                                 help="Bytes of shared memory the kernel (and rank 0, for the pull-back) may "
                                      "keep between cells, so that the next cell writes into memory already "
                                      "handed out (several times faster than fresh memory); a larger cell's "
                                      "file is emptied after the cell.")
    pull_chunk_bytes = Integer(64 << 20, config=True,
                               help="A sharded model comes back to the notebook in chunks of whole tensors of "
                                    "at most this many bytes (one tensor when it is larger), so that no process "
                                    "holds a second whole copy of it.")
    bring_back_limit = Integer(256 << 20, config=True,
                               help="A torch cell's effects come back into the notebook from rank 0, as a local run "
                                    "leaves them: the values it changes in place and the names it binds. Values it "
                                    "binds that are larger than this many bytes in all (a dataset loaded in the "
                                    "cell) stay on the workers, and the cell says so; --pull NAME brings one back. "
                                    "Models always come back.")
    rendezvous_address = Unicode("", config=True,
                                 help="For a cluster across hosts: where the ranks meet, an address of rank 0's "
                                      "host or a network (10.1.0.0/16) to take rank 0's address in. Default: rank "
                                      "0's address on the network of the other hosts' (else the one it reaches "
                                      "the controller or scheduler from). Each host's gloo then uses its "
                                      "interface toward that address (unless GLOO_SOCKET_IFNAME is set).")
    direct_channel = Bool(True, config=True,
                          help="When every worker runs on this machine, send each cell to the workers over "
                               "sockets of the kernel's own (in a directory only this user can open) "
                               "instead of through the engine: a cell's round trip in well under a "
                               "millisecond rather than several. The engine still starts, signals and "
                               "stops the workers.")
    collapse_output = Bool(None, allow_none=True, config=True,
                           help="Show a line that several ranks print alike at about the same time once, "
                                "labelled with their ranks ([rank 0-3] epoch 1 done); a rank's own lines stay "
                                "labelled with its rank. None (the default): above 2 workers.")
    collapse_window = Float(0.5, config=True,
                            help="Seconds a line waits for the other ranks to print it too (collapse_output): "
                                 "a line that not every rank prints shows this much later.")
    poll_interval = Float(0.1, config=True,
                          help="Longest wait between checks for deadlines while a cell runs "
                               "(results and output wake the kernel at once).")

    # The export's, kept beside it (see cellstart).
    export_keep_start = Bool(False, config=True,
                             help="Before each %%distribute cell, keep a deep copy of the notebook values it reads "
                                  "(as they are before it runs), so that %scale export after the cell writes the "
                                  "values the cell started from and its job repeats the run (--from start). Costs "
                                  "memory for a second copy of those values (the last cell's only) and the time to "
                                  "copy them at every cell. Off: nothing is copied, and an export after a cell saves "
                                  "the values as they are then (the trained weights) and says so.")


    write_watch = Bool(True, config=True,
                       help="Hash again, before and after each cell, only the pieces of tensors whose memory "
                            "pages were written since they were last hashed (Linux userfaultfd write "
                            "protection; see README, What %%distribute does). False hashes every tensor whole "
                            "every time: slower, for systems where the protection misbehaves.")

    @default("backend_name")
    def _default_backend_name(self) -> str:
        return os.environ.get("JUPYTER_SCALE_BACKEND", "").strip() or "ipyparallel"
