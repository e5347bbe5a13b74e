"""One rank of ``meshmorph run --elastic``: the trainer (run/trainer.py) with its state kept in
the node-local store (elastic/live/elastic_run.py), so a restarted worker rebuilds it.

torchrun's elastic agent runs ``python -m meshmorph.elastic.live.worker`` with the trainer's
arguments; the trainer itself knows nothing of elastic/.
"""

from __future__ import annotations

import argparse

from meshmorph.elastic.live.elastic_run import ElasticSession
from meshmorph.run.launch.launcher import parse_failure
from meshmorph.run.trainer import exit_now, main


def elastic_session(args: argparse.Namespace) -> ElasticSession:
    """This worker's link to its node store, from the trainer's parsed arguments."""
    return ElasticSession(args.elastic_run_id, args.out, parse_failure(args.inject_failure))


if __name__ == "__main__":
    exit_now(main(make_elastic=elastic_session))
