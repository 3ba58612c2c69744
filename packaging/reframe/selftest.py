"""ReFrame's own verdict on the template's tolerances, with ReFrame imported (``pip install reframe-hpc``)::

    python packaging/reframe/selftest.py [REFERENCES.yaml]

For each figure of merit, with the template's tolerances and a reference of 1 (and of its index line's
scale, 0.035 s): ``reframe.utility.sanity.assert_reference`` (what ReFrame's performance stage evaluates)
must fail a run 10 % worse and pass one 2 % better, and ``reference_bounds`` must give the bounds that
``fourd_reference.bounds`` computes. Prints one line per figure; exit 1 on the first disagreement.
"""

import os
import sys

import reframe.utility.sanity as sn
from reframe.core.exceptions import SanityError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fourd_reference import bounds, load_template, within  # noqa: E402

#: figures where a larger value is worse (a slowdown raises them); the others are throughputs
LOWER_IS_BETTER = ("step_time", "exposed_comm_share")


def passes(value, reference, lower, upper) -> bool:
    try:
        sn.evaluate(sn.assert_reference(value, reference, lower, upper))
    except SanityError:
        return False
    return True


def main() -> int:
    template = load_template(sys.argv[1] if len(sys.argv) > 1 else None)
    for fom, (lower, upper) in template["tolerances"].items():
        for reference in (1.0, 0.035, 81.5):
            worse, better = (1.10, 0.98) if fom in LOWER_IS_BETTER else (1 / 1.10, 1.02)
            verdicts = (passes(reference * worse, reference, lower, upper),
                        passes(reference * better, reference, lower, upper))
            ours = (within(reference * worse, reference, lower, upper),
                    within(reference * better, reference, lower, upper))
            theirs = tuple(sn.evaluate(sn.reference_bounds(reference, lower, upper)))
            if verdicts != (False, True) or ours != verdicts or theirs != bounds(reference, lower, upper):
                print(f"{fom}: reference {reference} ({lower}, {upper}): ReFrame passes 10 % worse: {verdicts[0]}, "
                      f"2 % better: {verdicts[1]}; fourd_reference: {ours}; bounds ReFrame {theirs}, "
                      f"fourd_reference {bounds(reference, lower, upper)}")
                return 1
        print(f"{fom}: ({lower}, {upper}): ReFrame fails 10 % worse, passes 2 % better; bounds agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
