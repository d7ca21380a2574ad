"""`ray start` (the embedded cluster's `ray start --head --block`), ended with the kernel by the
kernel's watcher (jupyter_scale.processes), which also removes the cluster's directory (its
token, logs and spilled objects)."""

import sys


def main() -> None:
    from ray.scripts.scripts import main as ray_main

    sys.argv[0] = "ray"
    ray_main()


if __name__ == "__main__":
    sys.path[0] = ""  # the working directory, as `python -c`, not this one (see programs)
    main()
