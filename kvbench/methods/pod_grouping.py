"""Moved to ``kvbench.analysis.pod_grouping`` (it runs a model; methods never do). ``python -m
kvbench.methods.pod_grouping`` still works for one release and forwards there."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("kvbench.analysis.pod_grouping", run_name="__main__", alter_sys=True)
