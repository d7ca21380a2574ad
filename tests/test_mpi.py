"""%scale start --launcher mpi: ipyparallel engines as the ranks of one real `mpiexec` (Open MPI):
rank i is MPI rank i, mpi4py works in the cell beside torch.distributed, the README's loop
trains as on the embedded cluster, and stop leaves no process."""
import shutil

import pytest

from conftest import README_DATA, README_LOOP, SAME_WEIGHTS, SETUP, wait_gone
from kernel import Kernel

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (apt-get install openmpi-bin)"),
    pytest.mark.timeout(300),
]
mpi4py = pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'jupyter_scale[mpi]')")

TRAIN = ("%%distribute\nfrom mpi4py import MPI\ncomm = MPI.COMM_WORLD" + README_LOOP
         + """# MPI's own collective beside torch.distributed's: the ranks agree on who is who.
seen = dict(mpi_rank=comm.Get_rank(), mpi_size=comm.Get_size(), ranks=comm.allgather(rank))
""")


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(backend="ipyparallel")
    try:
        k.ok(SETUP + README_DATA)
        yield k
    finally:
        k.cell("%scale stop", timeout=60)
        leftovers = k.descendants()
        k.shutdown()
        assert wait_gone(leftovers) == [], "the kernel left processes behind"


def test_the_ranks_are_mpi_ranks_and_the_readmes_loop_trains(kernel):
    k = kernel
    started = k.ok("%scale start --launcher mpi --workers 4", timeout=180)
    assert "with mpiexec" in started.stdout and "4 workers ready" in started.stdout, started.stdout
    engines = k.descendants()
    assert any(p.name() in ("mpiexec", "mpirun", "orterun", "prterun") for p in engines), [p.name() for p in engines]
    status = k.ok("%scale status").stdout
    assert status.startswith("jupyter_scale: MPI ipyparallel cluster, 4 workers"), status
    k.ok(TRAIN, timeout=240)
    k.ok(SAME_WEIGHTS.format(n=4))
    seen = k.value("jupyter_scale.get_session().gather('seen')")
    assert [s["mpi_rank"] for s in seen] == [0, 1, 2, 3]
    assert {s["mpi_size"] for s in seen} == {4}
    assert {tuple(s["ranks"]) for s in seen} == {(0, 1, 2, 3)}
    stopped = k.ok("%scale stop", timeout=60).stdout
    assert "stopped 4 workers" in stopped
    assert wait_gone(engines) == [], "mpiexec or a rank outlived %scale stop"


def test_mpi_on_dask_says_what_to_do_and_loses_nothing(kernel):
    k = kernel
    out = k.cell("%scale start --launcher mpi --backend dask --workers 2")
    assert not out.ok and out.error["ename"] == "ClusterError", out.error_text
    assert out.error["evalue"] == ("dask cannot start its workers with the mpi launcher; on Dask, start the cluster "
                                   "yourself (dask-mpi) and %scale connect to its scheduler"), out.error_text
    assert k.value("isinstance(model, nn.Module) and not jupyter_scale.get_session().running")
    k.ok("%scale start --launcher mpi --backend ipyparallel --workers 2", timeout=180)
    k.ok("%%distribute\nfrom mpi4py import MPI\nassert MPI.COMM_WORLD.Get_rank() == rank")
    k.ok("%scale stop", timeout=60)
