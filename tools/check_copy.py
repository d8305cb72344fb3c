"""Run a copied script as the tests run ours, and say which of the suite's guarantees it still keeps.

    python tools/check_copy.py my_train.py                                # a small MNIST made here
    python tools/check_copy.py my_train.py --data-dir D --test-rows 500   # its own data, and its test rows

The copy is started as its parent is: torchrun (03, 06, 08), --nprocs (04), -n 1 -g N (05), --devices N
--accelerator cpu (07), or plain python (01, 02); always with --cpu. It keeps the numbered scripts' flags
--data-dir, --epochs, --batch-size, --test-batch-size, --max-steps, --log-interval, --no-dropout, --cpu and
--save-model PATH (rank 0 saves the whole state dict), and with snapshots --snapshot and --snapshot-every; it
shards its training set with torch.utils.data.DistributedSampler and scores its test rows in eval() without
gradients. tools/copy_hook (on the runs' PYTHONPATH) records each process's sampler orders, the rows it scored
and the files it wrote; none of the copy's own measurement is needed. Per guarantee it prints `holds`,
`BROKEN`, or `n/a` where it could not try it, and what it saw; it exits 1 if any is BROKEN. A copy whose snapshot
is sharded with DCP, as 12's, is also resumed at another world size. Its runs go two
at a time, every script's queued at once. 09, 10 and 11, whose ranks share every batch, are refused in one line.
"""
import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the bench package, from the repository root
from bench.checks import EXIT_ABORT, EXIT_ABORT_AGAIN  # noqa: E402
from bench.commands import launch  # noqa: E402
from bench.fake_mnist import write_fake_mnist  # noqa: E402
from bench.family import MODES  # noqa: E402
from bench.machine import free_port  # noqa: E402
from bench.processes import run_processes  # noqa: E402

HOOK = Path(__file__).resolve().parent / "copy_hook"
BATCH, STEPS, TEST_BATCH = 8, 4, 64  # 4 steps a rank an epoch, 2 epochs
MNIST_TRAIN, MNIST_TEST = 960, 250  # 250 test rows: 3 ranks cannot split them evenly, so padding shows
TIMEOUT_S = 600
AGAIN = EXIT_ABORT_AGAIN  # runs again after torch's abort at a worker's exit (EXIT_ABORT), not the copy's
LOADER_HANG = "DataLoader timed out after"  # a loader worker stuck in its fork: docs/copying.md
TORCH_SIDE = (EXIT_ABORT, LOADER_HANG)  # what a run says when torch, not the copy, broke it
AT_ONCE = 2  # runs at a time: a short run waits mostly on its start-up, so two share 2 cores well
SHARDS = "each rank's training shard disjoint from the others' and reshuffled every epoch"
ROWS = "every test row scored once"
UPDATE = "the same update at 2 x B (2 processes) as at 1 x 2B (1 process)"
WRITES = "only rank 0 writes"
RESUME = "killed in epoch 2 and resumed: bitwise the uninterrupted run, dropout on"
RESHARD = "killed at 2 ranks and resumed at 4, at the same global batch: the same images, the weights to 1e-4"
CHECKS = dict(shards=SHARDS, rows=ROWS, writes=WRITES, update=UPDATE, resume=RESUME)  # --only's names
FAILED = []  # the logs of the runs that exited non-zero: kept for reading


def launch_kind(source):
    """How the copy starts its processes, as its parent does (tensor or pipeline parallel: ones the checks do not
    apply to)."""
    if "parallelize_module(" in source:
        return "tensor parallel"
    if "PipelineStage(" in source:
        return "pipeline parallel"
    if "import lightning" in source:
        return "lightning"
    if "mp.spawn(" in source:
        return "multinode" if "--node-rank" in source else "spawn"
    return "torchrun" if "init_process_group" in source else "single"


KIND_MODE = dict(single="single", torchrun="ddp_launch", spawn="ddp_spawn", multinode="ddp_multinode",
                 lightning="lightning")  # the row of the family table whose launch a copy's parent has


def command(script, kind, n, restarts=0):
    """As the family table starts the copy's parent, at n processes (05's kind as one "node" of n)."""
    mode = MODES[KIND_MODE[kind]]
    argv = launch(mode, script, n, [f"--max-restarts={restarts}"] if mode.launch.torchrun else ())
    argv += [mode.launch.port_flag, free_port()] if mode.launch.port_flag else []
    argv += ["-n", 1, "-g", n, "--master-port", free_port()] if mode.launch.nodes > 1 else []
    return argv + (["--accelerator", "cpu"] if kind == "lightning" else [])


def run(script, kind, n, args, folder, restarts=0, **env):
    """(the records of the run's processes, or None if it failed; its output, or why it stopped). A run that torch
    aborted at a worker's exit (EXIT_ABORT), or whose loader worker hung in its fork (LOADER_HANG), runs again from
    an empty folder, AGAIN times at most, and says so."""
    hook = folder / "hook"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HOOK), os.environ.get("PYTHONPATH")])),
           "CHECK_COPY_OUT": str(hook), "OMP_NUM_THREADS": "1", **env}
    argv = [str(a) for a in [*command(script, kind, n, restarts), *args, "--cpu"]]
    for attempt in range(1 + AGAIN):
        shutil.rmtree(folder, ignore_errors=True)  # no snapshot, record or weights of the aborted attempt
        hook.mkdir(parents=True)
        code, timed_out = run_processes([(env, argv)], [folder / "log.txt"], TIMEOUT_S)
        log = f"timed out after {TIMEOUT_S} s" if timed_out else (folder / "log.txt").read_text(errors="replace")
        torch_side = next((text for text in TORCH_SIDE if text in log), None)
        if code == 0 or not torch_side or attempt == AGAIN:
            break
        print(f"note: a process of {script.name} said {torch_side!r}: torch's, not the copy's "
              "(docs/copying.md); that run again", file=sys.stderr, flush=True)
    if code != 0:
        FAILED.append(folder / "log.txt")
    records = [json.loads(p.read_text()) for p in sorted(hook.glob("*.json"))]
    return (records if code == 0 else None), log


def last_line(log):
    """What a failed run said last: its last error line, else its last line that is not torchrun's frame."""
    lines = [line.strip() for line in log.splitlines() if line.strip(" =-")]
    errors = [line for line in lines if re.match(r"(error: |\w+(Error|Exception)\b)", line)]
    return (errors or lines)[-1]


def check_shards(records, n):
    orders = {}  # rank: [the order of each epoch, as asked for] of the shuffling samplers: the training set's
    for record in records:
        for s in record["samplers"]:
            if s["replicas"] == n and s["shuffle"]:
                orders.setdefault(s["rank"], []).append(s)
    if sorted(orders) != list(range(n)) or min(len(o) for o in orders.values()) < 2:
        return False, f"DistributedSamplers of {n} replicas gave two epochs' orders to ranks {sorted(orders)}"
    length = orders[0][0]["length"]
    for epoch in range(2):
        every = [i for r in range(n) for i in orders[r][epoch]["indices"]]
        padding = len(every) - length  # a training sampler pads to equal shares: at most n - 1 repeats
        if len(set(every)) != length or not 0 <= padding < n or len(every) - len(set(every)) != padding:
            return False, f"epoch {epoch + 1}: the {n} shards overlap or miss rows of the {length}"
    same = [r for r in range(n) if orders[r][0]["indices"] == orders[r][1]["indices"]]
    if same:
        return False, (f"rank {same[0]}'s shard is in the same order in epochs 1 and 2 (sampler epoch "
                       f"{orders[same[0]][1]['epoch']}): no set_epoch?")
    shards = f"{n} disjoint shards" if n > 1 else "1 shard"
    return True, f"{shards} of the {length} rows, a new order in epoch 2"


def check_rows(records, log, test_rows, evaluations=2):
    scored = sum(r["eval_rows"] for r in records)
    if scored != test_rows * evaluations:
        return False, f"{scored} rows scored in {evaluations} evaluations of {test_rows} rows (padded? dropped?)"
    counted = [int(c) for c in re.findall(r"of (\d+) test samples", log)]  # 03's message, if kept
    if any(c != test_rows for c in counted):
        return False, f"{test_rows} rows scored in each of {evaluations} evaluations, but counted as {counted}"
    return True, f"{test_rows} rows scored in each of {evaluations} evaluations" + (
        f", and counted: {test_rows} test samples" if counted else "")


def check_writes(records):
    """Only rank 0 writes, but for each rank's own shard file of a sharded snapshot (12's DCP: __R_0.distcp)."""
    written = {(w["rank"], w["path"]) for r in records for w in r["writes"] if w["rank"] != 0}
    others = sorted(path for rank, path in written
                    if not re.fullmatch(rf"__{rank}_\d+\.distcp", os.path.basename(path)))
    return (False, f"rank != 0 wrote {others[0]}") if others else (
        True, "only rank 0 wrote, but each rank its own shard files" if written else "only rank 0 wrote")


def cannot_match(source):
    """Why 2 x B cannot give 1 x 2B's update for this model, and what to change to compare; "" if it can."""
    if re.search(r"BatchNorm\d?d?\(", source) and "SyncBatchNorm" not in source:
        return ("BatchNorm normalises each rank's own batch, so 2 x B cannot equal 1 x 2B on the CPU: compare "
                "with BatchNorm in eval() or replaced, or on GPUs with nn.SyncBatchNorm")
    if re.search(r"\bRandom[A-Z]\w*\(", source):
        return ("a random augmentation draws other numbers at 2 x B than at 1 x 2B: compare with it switched "
                "off (its seed cannot make the two runs agree)")
    return ""


def check_update(script, kind, common, out):
    if kind == "single":
        return True, "one process: nothing to compare"
    why = cannot_match(script.read_text())
    if why:
        return None, f"not checked: {why}"
    paths = {}
    for n, batch in [(2, BATCH), (1, 2 * BATCH)]:
        paths[n] = out / f"update-{n}" / "model.pt"
        records, log = run(script, kind, n, [*common, "--epochs", 1, "--no-dropout", "--batch-size", batch,
                                             "--save-model", paths[n]], paths[n].parent)
        if records is None:
            return False, f"the run at {n} x {batch} failed: {last_line(log)}"
    a, b = (torch.load(paths[n], map_location="cpu") for n in (2, 1))
    far = max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys() else float("inf")
    return far < 1e-4, f"the weights differ by at most {far:.1e}"


def check_resume(script, kind, args, out):
    """2 epochs uninterrupted, and the same killed: rank 0 dies at its training forward STEPS + 2 (epoch 2, step
    1), once it has written the snapshot taken after step 0; torchrun restarts both ranks once, and they must
    resume at step 1. An odd step: with 2 or more loader workers, batch 1 comes from worker 0 after the resume
    and from worker 1 without it, so randomness taken from the worker shows. At 2 ranks: at 3 or more a fresh
    DDP's first step sums the gradients in another order than the uninterrupted run's (DDP rebuilds its buckets
    after its first step; gloo's ring then adds the ranks' parts in another order)."""
    paths, runs = {}, {}
    for name, restarts, env in [("uninterrupted", 0, {}),
                                ("killed", 1, dict(CHECK_COPY_KILL_AT=str(STEPS + 2), CHECK_COPY_KILL_RANK="0",
                                                   CHECK_COPY_SNAPSHOT=str(out / "killed" / "s.pt")))]:
        paths[name] = out / name / "model.pt"
        records, log = run(script, kind, 2, [*args, "--snapshot", out / name / "s.pt", "--save-model", paths[name]],
                           out / name, restarts, **env)
        if records is None:
            return False, f"the {name} run failed{' under --max-restarts 1' if restarts else ''}: {last_line(log)}"
        runs[name] = records
    if not list((out / "killed" / "hook").glob("killed-*.json")):
        return None, "not checked: no snapshot written by epoch 2, step 1, so nothing was killed"
    if not any(r["restart"] == "1" for r in runs["killed"]):
        return False, "killed in epoch 2, step 1, but torchrun started no second attempt"
    whole = max(r["train_forwards"] for r in runs["uninterrupted"])
    again = max(r["train_forwards"] for r in runs["killed"] if r["restart"] == "1")
    if again >= whole:
        return False, f"the restart trained {again} steps, as many as a whole run: it started over, not resumed"
    a, b = (torch.load(paths[name], map_location="cpu") for name in ("uninterrupted", "killed"))
    differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    if differ:
        far = max((a[k].float() - b[k].float()).abs().max().item() if k in b else float("inf") for k in differ)
        return False, f"{len(differ)} of {len(a)} tensors differ from the uninterrupted run's, by up to {far:.1e}"
    losses = [train_losses(out / name / "log.txt") for name in ("uninterrupted", "killed")]
    if losses[0] and losses[1] and losses[0][-1] != losses[1][-1]:  # the weights alone miss a lost loss sum
        return False, f"the resumed epoch's train loss is {losses[1][-1]}, not {losses[0][-1]}"
    return True, (f"killed at epoch 2, step 1; resumed there ({again} steps, not {whole}): all {len(a)} tensors "
                  "equal to the uninterrupted run's" + (", and its train loss" if losses[0] else ""))


def check_reshard(script, kind, args, out):
    """A sharded snapshot (DCP) resumes at another world size: 2 ranks are killed in epoch 2, step 1, as in the
    resume check, and 4 ranks at half the batch, so at the same global batch, go on from their snapshot. Dropout
    off: 4 ranks draw other masks than 2. Each step left must train the images the uninterrupted run's step
    trains, and the weights must end within 1e-4 of its."""
    paths, records, snapshot = {}, {}, out / "reshard-killed" / "s.pt"
    kill = dict(CHECK_COPY_KILL_AT=str(STEPS + 2), CHECK_COPY_KILL_RANK="0", CHECK_COPY_SNAPSHOT=str(snapshot))
    for name, n, batch, env in [("reshard-whole", 2, BATCH, {}), ("reshard-killed", 2, BATCH, kill),
                                ("reshard-resumed", 4, BATCH // 2, {})]:
        paths[name] = out / name / "model.pt"
        own = out / name / "s.pt" if name == "reshard-whole" else snapshot
        records[name], log = run(script, kind, n, [*args, "--no-dropout", "--batch-size", batch, "--snapshot", own,
                                                   "--save-model", paths[name]], out / name, **env)
        if (records[name] is None) != (name == "reshard-killed"):
            return False, f"the run of {n} ranks at {batch} each {'ended' if env else 'failed'}: {last_line(log)}"
        if env:
            FAILED.remove(out / name / "log.txt")  # killed, as it was meant to be
    if not list((out / "reshard-killed" / "hook").glob("killed-*.json")):
        return None, "not checked: no snapshot written by epoch 2, step 1, so nothing was killed"
    trained = max(r["train_forwards"] for r in records["reshard-resumed"])
    if trained != STEPS - 1:
        return False, f"at 4 ranks it trained {trained} steps, not the {STEPS - 1} left after epoch 2, step 1"
    differ = same_images(records["reshard-whole"], records["reshard-resumed"], range(1, STEPS), (BATCH, BATCH // 2))
    if differ:
        return False, differ
    a, b = (torch.load(paths[name], map_location="cpu") for name in ("reshard-whole", "reshard-resumed"))
    far = max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys() else float("inf")
    return far < 1e-4, (f"killed at 2 x {BATCH} in epoch 2, step 1, resumed at 4 x {BATCH // 2}: steps 1-"
                        f"{STEPS - 1} trained the uninterrupted run's images; the weights end within {far:.1e} of its")


def same_images(whole, resumed, steps, batches):
    """"" if each of the steps of the last epoch trains, over all the resumed run's ranks, the images the same step
    of the whole run trains over its ranks; else what differs. A rank trains consecutive slices of its order."""
    def per_step(records, batch):
        orders = [s for r in records for s in r["samplers"] if s["shuffle"]]
        epoch = max((s["epoch"] for s in orders), default=None)
        last = [s for s in orders if s["epoch"] == epoch]
        return epoch, [sorted(i for s in last for i in s["indices"][k * batch:(k + 1) * batch]) for k in steps]
    (epoch, expected), (resumed_epoch, got) = per_step(whole, batches[0]), per_step(resumed, batches[1])
    if resumed_epoch != epoch:
        return f"the resumed run's last epoch is sampler epoch {resumed_epoch}, not {epoch}"
    step = next((k for k, a, b in zip(steps, got, expected) if a != b), None)
    return "" if step is None else f"epoch 2, step {step}: the resumed ranks trained other images than 2 ranks did"


def sharded(source):
    """Whether the copy's snapshot is sharded, as 12's: each rank saves its own part with DCP."""
    return bool(re.search(r"\bdcp\.save\(|distributed\.checkpoint\.save\(|FileSystemWriter\(", source))


def train_losses(log):
    """The "epoch N: train loss X" figures a run printed, in order (none if it prints no such line)."""
    return re.findall(r"epoch \d+: train loss ([\d.]+)", log.read_text(errors="replace"))


def takes_snapshots(source):
    return "--snapshot" in source


def world_size_for(test_rows):
    """The fewest ranks from 3 up that cannot split the test rows evenly: a padded or a dropped share shows."""
    return next(k for k in range(3, 64) if test_rows % k)


def check(script, kind, data_args, test_rows, out, only, pool):
    """Queue the script's runs on pool, in folders under out; only: which checks. Returns a function that waits
    for them and gives [(guarantee, held, what was seen)]."""
    source = script.read_text()
    n = 1 if kind == "single" else world_size_for(test_rows)
    common = [*data_args, "--max-steps", STEPS, "--test-batch-size", TEST_BATCH, "--log-interval", 0]
    args = [*common, "--epochs", 2, "--batch-size", BATCH]
    snapshots = ["--snapshot-every", 1] if takes_snapshots(source) else []  # and each run its --snapshot

    def whole():  # shards, rows and writes, all three from one run at n ranks (1 for a one-process copy)
        records, log = run(script, kind, n, [*args, "--save-model", out / "whole" / "model.pt",
                                             *(snapshots and [*snapshots, "--snapshot", out / "whole" / "s.pt"])],
                           out / "whole")
        if records is None:
            return None, last_line(log)
        seen = dict(shards=lambda: check_shards(records, n), rows=lambda: check_rows(records, log, test_rows),
                    writes=lambda: check_writes(records))
        return [(CHECKS[key], *seen[key]()) for key in seen if key in only], ""

    groups = [pool.submit(whole) if {"shards", "rows", "writes"} & set(only) else None,  # independent runs
              pool.submit(check_update, script, kind, common, out) if "update" in only else None,
              pool.submit(check_resume, script, kind, [*args, *snapshots], out)
              if "resume" in only and snapshots else None,
              pool.submit(check_reshard, script, kind, [*args, *snapshots], out)
              if "resume" in only and snapshots and sharded(source) else None]

    def verdicts():
        ran, update, resume, reshard = (group and group.result() for group in groups)
        if ran and ran[0] is None:
            return [("it runs", False, ran[1])]
        return [*(ran[0] if ran else []), *([(UPDATE, *update)] if update else []),
                *([(RESUME, *resume)] if resume else []), *([(RESHARD, *reshard)] if reshard else [])]
    return verdicts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("scripts", nargs="+", type=Path)
    p.add_argument("--data-dir", type=Path, help="the copy's own data (default: a small MNIST made here)")
    p.add_argument("--test-rows", type=int, help="how many test rows the data in --data-dir has")
    p.add_argument("--only", type=lambda text: text.split(","), default=list(CHECKS),
                   help=f"some of the checks, comma-separated: {','.join(CHECKS)} (resume: with --snapshot)")
    p.add_argument("--keep", type=Path, help="keep the runs' folders (logs, hook records, weights) here")
    args = p.parse_args(argv)
    if set(args.only) - set(CHECKS):
        sys.exit(f"error: --only takes {','.join(CHECKS)}, not {','.join(set(args.only) - set(CHECKS))}")
    if (args.data_dir is None) != (args.test_rows is None):
        sys.exit("error: give --data-dir and --test-rows together")
    for script in args.scripts:
        if not script.is_file():
            sys.exit(f"error: {script}: no such file")
    sources = [(script, script.read_text()) for script in args.scripts]
    for script, source in sources:
        if launch_kind(source) in ("tensor parallel", "pipeline parallel"):  # refused before any run
            sys.exit(f"error: {script} is {launch_kind(source)}: its ranks share every batch, and the checks "
                     "here are data parallel's")
    work = Path(tempfile.mkdtemp(prefix="check_copy-"))
    try:
        if args.data_dir is None:
            data_dir, test_rows = Path(write_fake_mnist(str(work / "mnist"), MNIST_TRAIN, MNIST_TEST)), MNIST_TEST
        else:
            data_dir, test_rows = args.data_dir.resolve(), args.test_rows
        failed, pool = False, ThreadPoolExecutor(AT_ONCE)  # every script's runs queued at once, AT_ONCE at a time
        kinds = [launch_kind(source) for _, source in sources]
        pending = [check(script.resolve(), kind, ["--data-dir", data_dir], test_rows, work / f"{i}-{script.stem}",
                         args.only, pool) for i, ((script, _), kind) in enumerate(zip(sources, kinds))]
        for (script, source), kind, verdicts in zip(sources, kinds, pending):
            print(f"{script} ({kind}):", flush=True)
            for guarantee, held, seen in verdicts():
                print(f"  {({True: 'holds ', False: 'BROKEN', None: 'n/a   '})[held]}  {guarantee}: {seen}",
                      flush=True)
                failed |= held is False
            if "resume" in args.only and not takes_snapshots(source):
                print(f"  n/a     {RESUME}: it takes no --snapshot, so it has nothing to resume", flush=True)
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
    finally:
        if FAILED:
            print("the failed runs' logs, kept:", *FAILED, sep="\n  ", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
