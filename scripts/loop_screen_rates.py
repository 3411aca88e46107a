"""How often the cross-step loop screen would fire on finished trajectories (offline, no model).

Replays the committed steps of every record of bench cells (``<run>/cells/*.json``) through
:class:`dynts.rescue.StepLoopDetector`: the fraction of steps it would have screened, and how many
right / wrong trajectories contain at least one such step. On full-cache trajectories every firing
is a false positive; that picks ``repeat_ngram``.

    python scripts/loop_screen_rates.py reports/rescue/B64-N4 --cells full,kvr-dynts --ngrams 6,7,8
"""

from __future__ import annotations

import argparse
import glob
import json
import re
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a dynts rescue bench run directory")
    p.add_argument("--cells", default="full,kvr-dynts,bon-dynts,evict-dynts", help="cell name prefixes")
    p.add_argument("--ngrams", default="6,7,8")
    p.add_argument("--pattern", default="1,4,2", help="MIN,MAX,COUNT of the step-pattern rule, or 0")
    p.add_argument("--tokenizer", default="testbed")
    p.add_argument("--delimiter", default=";")
    args = p.parse_args()
    import dynts
    from dynts.rescue import StepLoopDetector, delimiter_token_ids

    _, tok = dynts.load(args.tokenizer)
    ignore = delimiter_token_ids(tok, args.delimiter)
    pattern = (1, 0, 2) if args.pattern == "0" else tuple(int(v) for v in args.pattern.split(","))
    print("| cell | repeat_ngram | steps screened % | by repeat / pattern | right trajectories fired | wrong trajectories fired |")
    print("|---|---|---|---|---|---|")
    for name in args.cells.split(","):
        # the cell key then its 10-digit fingerprint (so "full" never picks a "full-search-..." cell)
        paths = [p for p in sorted(glob.glob(str(args.run / "cells" / f"{name}-*.json")))
                 if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{10}}\.json", Path(p).name)]
        if not paths:
            raise SystemExit(f"no cell {name}-<fingerprint>.json in {args.run / 'cells'}")
        cell = json.loads(Path(paths[0]).read_text())
        for n in (int(v) for v in args.ngrams.split(",")):
            detector = StepLoopDetector(repeat_ngram=n, min_pattern_size=pattern[0], max_pattern_size=pattern[1], min_count=pattern[2])
            steps = fired = 0
            reasons = {"repeat": 0, "pattern": 0}
            hit = {True: [0, 0], False: [0, 0]}  # correct -> [fired, total]
            for record in cell["records"]:
                history, any_fired = detector.history(ignore), False
                for text in [s for s in record["text"].split(args.delimiter) if s.strip() and "</think>" not in s]:
                    ids = tok(text, add_special_tokens=False)["input_ids"]
                    reason = history.check(ids)
                    steps += 1
                    if reason:
                        fired, any_fired = fired + 1, True
                        reasons[reason] += 1
                    history.commit(ids)
                hit[record["correct"]][0] += any_fired
                hit[record["correct"]][1] += 1
            print(f"| {name} | {n} | {100 * fired / max(1, steps):.1f} | {reasons['repeat']} / {reasons['pattern']} | "
                  f"{hit[True][0]} / {hit[True][1]} | {hit[False][0]} / {hit[False][1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
