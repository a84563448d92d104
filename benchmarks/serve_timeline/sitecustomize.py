"""A timeline of a served benchmark, recorded in every Python process that has this folder on PYTHONPATH and
DSCALE_TIMELINE set (a folder): the collector's pauses (every full collection, any other over 2 ms), the engine
thread's steps (start, wall, live requests) and admissions, the HTTP process's submissions and pipe deliveries
(`--engine-process`), and the bench clients' requests (start, first token, end), all on `time.perf_counter`
(CLOCK_MONOTONIC on Linux: one clock for every process of the host). One JSON file per process, written when the
engine thread or the engine process's client stops, after each client pass and at exit. DSCALE_TIMELINE_TYPES=N
also records, after every full collection, the N most common types among the objects of the oldest generation (what
the next full collection walks; counting them takes time of its own, outside the recorded pause). Nothing is
recorded without DSCALE_TIMELINE; the project never imports this file. `benchmarks/serve_timeline.py` reads the folder.

    DSCALE_TIMELINE=/tmp/tl PYTHONPATH=benchmarks/serve_timeline:$PYTHONPATH dscale-bench --launch ...

(`dscale-bench`, or `python -c "from dscale_runtime.bench import main; main()"`: under `python -m dscale_runtime.bench`
the clients' module is `__main__`, which this file does not patch.)
"""
import atexit, collections, functools, gc, importlib.abc, importlib.util, json, os, sys, time
OUT = os.environ.get("DSCALE_TIMELINE")
if OUT:
    os.makedirs(OUT, exist_ok=True)
    _rec = {"gc": [], "step": [], "admit": [], "events": [], "submit": [], "client": [], "types": []}
    TYPES = int(os.environ.get("DSCALE_TIMELINE_TYPES", "0"))
    _gs = {}
    def _path():
        return os.path.join(OUT, f"{os.getpid()}.json")
    def dump():
        try:
            with open(_path(), "w") as f:
                json.dump({"argv": sys.argv[:3], "pid": os.getpid(), **_rec}, f)
        except Exception as e:
            print("serve_timeline: writing", _path(), "failed:", e, file=sys.stderr)
    atexit.register(dump)
    def _cb(phase, info):
        if phase == "start":
            _gs["s"] = time.perf_counter()
        else:
            s = _gs.get("s")
            if s is None:
                return
            d = time.perf_counter() - s
            if d > 0.002 or info.get("generation") == 2:
                _rec["gc"].append((s, d, info["generation"], info["collected"]))
            if TYPES and info.get("generation") == 2:  # what the full collection walked: the oldest generation
                counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}"
                                             for o in gc.get_objects(generation=2))
                _rec["types"].append((s, sum(counts.values()), counts.most_common(TYPES)))
    gc.callbacks.append(_cb)

    def patch_worker(m):
        W = m.EngineWorker
        step, admit, stop = W._step, W._admit, W.stop
        def _step(self):
            s = time.perf_counter()
            step(self)
            _rec["step"].append((s, time.perf_counter() - s, len(self._live)))
        def _admit(self, sub):
            _rec["admit"].append((time.perf_counter(), getattr(sub, "arrival", None)))
            admit(self, sub)
        def _stop(self, *a, **k):
            stop(self, *a, **k)
            dump()
        W._step, W._admit, W.stop = _step, _admit, _stop
    def patch_engine_process(m):
        C = m.EngineProcessClient
        ev, sub, stop = C._events, C.submit, C.stop
        def _events(self, events, observations):
            _rec["events"].append((time.perf_counter(), len(events)))
            ev(self, events, observations)
        def _submit(self, s):
            _rec["submit"].append((time.perf_counter(), s.arrival))
            sub(self, s)
        def _stop(self, *a, **k):  # NOTE: uvicorn re-raises SIGTERM after its shutdown: no atexit in this process
            stop(self, *a, **k)
            dump()
        C._events, C.submit, C.stop = _events, _submit, _stop
    def patch_bench(m):
        send, part = m._send, m._client_part
        @functools.wraps(send)
        async def _send(*a, **k):
            r = await send(*a, **k)
            _rec["client"].append((r["start"], r["first"], r["end"], r["tokens"]))
            return r
        @functools.wraps(part)
        def _part(*a, **k):
            out = part(*a, **k)
            dump()
            return out
        m._send, m._client_part = _send, _part
    PATCH = {"dscale_runtime.server.worker": patch_worker, "dscale_runtime.server.engine_process": patch_engine_process,
             "dscale_runtime.bench": patch_bench}

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in PATCH:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            class _L(importlib.abc.Loader):  # NOTE: `python -m` of a patched module runs its code unpatched
                def __getattr__(self, attr):
                    return getattr(loader, attr)
                def create_module(self, s):
                    return loader.create_module(s)
                def exec_module(self, module):
                    loader.exec_module(module)
                    PATCH[name](module)
            spec.loader = _L()
            return spec
    sys.meta_path.insert(0, _Finder())
