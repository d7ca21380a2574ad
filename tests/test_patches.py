"""The registry of what jupyter_scale patches (jupyter_scale/patches.py): installed on use and
once, listed, and removed to the very objects that were there; and on a real kernel, what
`%scale patches` shows, what `%scale stop` and `%unload_ext` leave, and `prepare()`."""

import sys
import types

import pytest
import torch

from conftest import README_DATA, README_LOOP, SAME_WEIGHTS, kernel_fixture
from jupyter_scale import patches


class Base:
    def greet(self):
        return "base"


class Child(Base):
    @staticmethod
    def make():
        return "made"

    def own(self):
        return "own"


def helper():
    return "helper"


@pytest.fixture
def target(monkeypatch):
    """A module `patch_target` holding Child and `helper` (also bound as `alias`), importable by name."""
    module = types.ModuleType("patch_target")
    module.Child, module.helper, module.alias = Child, helper, helper
    monkeypatch.setitem(sys.modules, "patch_target", module)
    yield module
    patches.remove_all("test")
    assert [r for r in patches.installed() if r.feature == "test"] == []


def test_install_lists_and_remove_restores_the_original_object(target):
    own = vars(Child)["own"]
    patch = patches.Patch("patch_target.Child.own", "to see", "test")
    patch.install(lambda original: lambda self: "patched " + original(self))
    assert Child().own() == "patched own"
    assert patches.Record("patch_target.Child.own", "to see", "test") in patches.installed()
    assert patches.installed("test") == [patch.record]
    assert patch.remove()
    assert vars(Child)["own"] is own and Child().own() == "own"
    assert patches.installed("test") == []


def test_an_inherited_attribute_is_inherited_again_and_a_staticmethod_stays_one(target):
    make = vars(Child)["make"]
    inherited = patches.Patch("patch_target.Child.greet", "to see", "test")
    static = patches.Patch("patch_target.Child.make", "to see", "test")
    inherited.install(lambda original: lambda self: "child's")
    static.install(lambda original: staticmethod(lambda: "other"))
    assert (Child().greet(), Child.make()) == ("child's", "other")
    assert patches.remove_all("test") == []
    assert "greet" not in vars(Child) and Child().greet() == "base"
    assert vars(Child)["make"] is make and isinstance(vars(Child)["make"], staticmethod)


def test_a_second_install_is_the_same_patch(target):
    made = []
    patch = patches.Patch("patch_target.helper", "to see", "test")
    first = patch.install(lambda original: made.append(1) or (lambda: "patched"))
    second = patch.install(lambda original: made.append(2) or (lambda: "again"))
    assert first is second is target.helper and made == [1]
    assert patches.installed("test") == [patch.record]
    assert patch.original is helper


def test_also_patches_the_other_names_of_the_original(target):
    patch = patches.Patch("patch_target.helper", "to see", "test", also=("patch_target.alias",))
    replacement = patch.install(lambda original: lambda: "patched")
    assert target.alias is replacement
    patch.remove()
    assert target.helper is helper and target.alias is helper


def test_a_patch_patched_over_stays_and_is_said(target):
    patch = patches.Patch("patch_target.helper", "to see", "test")
    patch.install(lambda original: lambda: "ours")

    def theirs():
        return "theirs"

    target.helper = theirs
    assert patches.remove_all("test") == [patch.record]
    assert target.helper is theirs and patch.is_installed  # theirs kept; ours still listed
    target.helper = patch.install(lambda original: None)  # they put ours back: now it goes
    assert patch.remove() and target.helper is helper


def test_hooks_during_and_features(target):
    hooks = []
    hook = patches.Patch("patch_target.hooks", "to see", "test")
    hook.hook(lambda: (hooks.append("on"), hooks.clear)[1])
    hook.hook(lambda: (hooks.append("twice"), hooks.clear)[1])
    assert hooks == ["on"]
    other = patches.Patch("patch_target.alias", "to see", "test other")
    with other.during(lambda original: lambda: "during"):
        assert target.alias() == "during" and other.is_installed
    assert target.alias is helper and not other.is_installed
    other.install(lambda original: lambda: "kept")
    patches.remove_all(["test", "test other"], keep=["test other"])
    assert hooks == [] and target.alias() == "kept"  # only the hook's feature went
    patches.remove_all("test other")
    assert target.alias is helper
    assert "patch_target.alias" in patches.describe([other.record]) and "(none)" in patches.describe([])


def test_automatic_mode_patches_torch_and_removing_puts_torch_back():
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    from torch.utils.data import DataLoader

    import jupyter_scale.training as training

    def now():
        return (vars(DataLoader)["__init__"], vars(DataLoader)["__iter__"], torch.autograd.backward,
                vars(torch.optim.Optimizer)["__init__"], torch.nn.utils.clip_grad_norm_,
                torch.nn.utils.clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_value_)

    assert patches.remove_all(patches.AUTOMATIC) == []
    originals, hooks = now(), dict(_global_optimizer_pre_hooks)
    training._install_patches()
    training._install_patches()
    listed = [r.target for r in patches.installed(patches.AUTOMATIC)]
    assert len(listed) == len(set(listed)) == 8 and "torch.optim.Optimizer.step" in listed
    assert not any(a is b for a, b in zip(now(), originals))
    assert torch.nn.utils.clip_grad_norm_ is torch.nn.utils.clip_grad.clip_grad_norm_
    assert len(_global_optimizer_pre_hooks) == len(hooks) + 1
    assert patches.remove_all(patches.AUTOMATIC) == []
    assert all(a is b for a, b in zip(now(), originals)) and dict(_global_optimizer_pre_hooks) == hooks
    with training.AutoMode(0):  # on use, again
        assert len(patches.installed(patches.AUTOMATIC)) == 8


def test_init_process_group_has_one_patch_for_workers_and_scripts_and_marks_go_too():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    import jupyter_scale.collectives as collectives
    import jupyter_scale.script  # noqa: F401  (a script's import installs it)
    import jupyter_scale.torchrun as torchrun
    import jupyter_scale.worker as worker

    patches.remove_all([patches.TORCHRUN, patches.MARKS])
    init, all_reduce = dist.init_process_group, dist.all_reduce
    assert c10d.init_process_group is init and c10d.all_reduce is all_reduce
    torchrun.keep_process_group()
    torchrun.keep_process_group(worker._rejoin)
    collectives.install_marks()
    assert dist.init_process_group is c10d.init_process_group is not init
    assert dist.init_process_group.__wrapped__ is init and dist.all_reduce is c10d.all_reduce is not all_reduce
    targets = [r.target for r in patches.installed() if r.feature in (patches.TORCHRUN, patches.MARKS)]
    assert targets.count("torch.distributed.distributed_c10d.init_process_group") == 1
    assert "torch.distributed.all_reduce" in targets and len(targets) == len(set(targets))
    assert patches.remove_all([patches.TORCHRUN, patches.MARKS]) == []
    assert dist.init_process_group is c10d.init_process_group is init
    assert dist.all_reduce is c10d.all_reduce is all_reduce


# -- a real kernel -------------------------------------------------------------------------------

kernel = kernel_fixture(["ipyparallel"])

KERNEL_PATCHES = "[r.target for r in jupyter_scale.patches.installed() if r.feature != 'library objects']"


@pytest.mark.cluster
def test_scale_patches_lists_rank0s_and_stop_and_unload_leave_none_in_the_kernel(kernel):
    kernel.ok("import sys\n" + README_DATA)
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300)
    listed = kernel.ok("%scale patches").stdout
    rank0 = listed.split("on rank 0", 1)[1]
    assert "torch.optim.Optimizer.step" in rank0 and "[automatic mode]" in rank0
    assert "torch.distributed.distributed_c10d.init_process_group" in rank0
    assert "patches in the kernel" in listed and "patches: " in kernel.ok("%scale").stdout
    kernel.ok("%scale stop", timeout=60)
    assert kernel.value(KERNEL_PATCHES) == []
    kernel.ok("%unload_ext jupyter_scale")
    assert kernel.value("jupyter_scale.patches.installed()") == []
    assert kernel.value("any(type(f).__name__ == '_ImportWatch' for f in sys.meta_path)") is False
    kernel.ok("%load_ext jupyter_scale")
    assert kernel.value("[r.target for r in jupyter_scale.patches.installed()]") == ["sys.meta_path"]


PREPARED_LOOP = README_LOOP.replace(
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "model, opt, loader = jupyter_scale.prepare(model, opt, loader, seed=SEED)\n")


@pytest.mark.cluster
def test_prepare_under_manual_trains_as_automatic_mode(kernel):
    kernel.ok("import copy\n" + README_DATA + "start = copy.deepcopy(model)")
    kernel.ok("%%distribute --workers 2\n" + README_LOOP, timeout=300)
    kernel.ok("automatic = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
              "SEED = jupyter_scale.get_session().runs[-1].seed\n"
              "model = copy.deepcopy(start)")
    kernel.ok("%%distribute --manual\n" + PREPARED_LOOP, timeout=300)
    kernel.ok(SAME_WEIGHTS.format(n=2))
    assert kernel.value("isinstance(model, nn.Sequential)") is True  # the notebook keeps its module
    assert kernel.value("(automatic - torch.cat([p.detach().flatten() for p in model.parameters()])).abs().max().item() "
                        "<= 1e-5") is True
    assert kernel.value("jupyter_scale.prepare(model, None, None)[0] is model") is True  # no-op outside a cell
