"""Reads Ember's TensorBoard event files with TensorBoard's own readers (tests/tensorboard_readback.sh).

  tb_check.py match RUN_DIR [--histograms]   every metrics.csv cell is a TensorBoard scalar with the
                                             same tag, step and value (float32), and nothing else is;
                                             the config is there as text and as hparams
  tb_check.py same RUN_A RUN_B               the same scalars (tag, step) with the same values
  tb_check.py images RUN_DIR TAG N           N images tagged TAG: PNG files whose size TensorBoard
                                             reads, byte for byte the run folder's TAG.png (the last)
"""
import csv
import glob
import os
import sys
from collections import Counter

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.util import tensor_util

KEEP_ALL = {event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0, event_accumulator.TENSORS: 0}


def tb_scalars(run_dir):
    """(tag, step, float32 value) multiset, after TensorBoard's restart purge (SessionLog START)."""
    acc = event_accumulator.EventAccumulator(run_dir, size_guidance=KEEP_ALL)
    acc.Reload()
    out = Counter()
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            out[(tag, ev.step, np.float32(ev.value))] += 1
    return acc, out


def csv_scalars(run_dir):
    out = Counter()
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and v != "":
                    out[(k, step, np.float32(float(v)))] += 1
    return out


def match(run_dir, histograms):
    files = glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert files, "no event file in " + run_dir
    acc, tb = tb_scalars(run_dir)
    cs = csv_scalars(run_dir)
    assert cs, "metrics.csv is empty"
    missing, extra = cs - tb, tb - cs
    assert not missing and not extra, f"csv-only: {sorted(missing)[:10]}  tensorboard-only: {sorted(extra)[:10]}"
    tags = {t for t, _, _ in tb}
    assert "train_loss_step" in tags or "train_loss" in tags, tags
    # Every scalar has a wall time from this run.
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            assert ev.wall_time > 1.5e9, (tag, ev.wall_time)
    if histograms:
        htags = acc.Tags()["histograms"]
        assert any(t.startswith("weights/") for t in htags) and any(t.startswith("grads/") for t in htags), htags
        for t in htags:
            for h in acc.Histograms(t):
                v = h.histogram_value
                assert v.num > 0 and abs(sum(v.bucket) - v.num) < 1e-6, (t, v.num, sum(v.bucket))
                assert v.min <= v.max
    # Config as text and as hparams (read the way TensorBoard's plugins read them).
    pacc = plugin_event_accumulator.EventAccumulator(run_dir, size_guidance=KEEP_ALL)
    pacc.Reload()
    text = pacc.Tensors("config")[0].tensor_proto
    body = tensor_util.make_ndarray(text).item().decode()
    assert "[trainer]" in body and "[model]" in body, body[:200]
    content = pacc.PluginTagToContent("hparams")
    start = hparams_metadata.parse_session_start_info_plugin_data(content["_hparams_/session_start_info"])
    hp = dict(start.hparams)
    assert hp["model.name"].string_value == "mlp", hp.get("model.name")
    assert hp["trainer.max_epochs"].number_value > 0, hp.get("trainer.max_epochs")
    end = hparams_metadata.parse_session_end_info_plugin_data(content["_hparams_/session_end_info"])
    assert end.status == 1, end  # STATUS_SUCCESS
    n = sum(tb.values())
    print(f"tensorboard read back {n} scalars over {len(tags)} tags, all equal to metrics.csv; "
          f"{len(hp)} hparams; {len(acc.Tags()['histograms'])} histogram tags")


def same(a, b):
    _, ta = tb_scalars(a)
    _, tb = tb_scalars(b)
    ka = Counter((t, s) for (t, s, _), n in ta.items() for _ in range(n))
    kb = Counter((t, s) for (t, s, _), n in tb.items() for _ in range(n))
    assert ka == kb, f"only in {a}: {sorted(ka - kb)[:10]}; only in {b}: {sorted(kb - ka)[:10]}"
    va = {(t, s): v for (t, s, v) in ta}
    vb = {(t, s): v for (t, s, v) in tb}
    for k in va:
        assert np.isclose(va[k], vb[k], rtol=1e-5, atol=1e-6), (k, va[k], vb[k])
    print(f"same {sum(ka.values())} scalars in both runs")


def images(run_dir, tag, count):
    acc = event_accumulator.EventAccumulator(run_dir, size_guidance={event_accumulator.IMAGES: 0})
    acc.Reload()
    assert tag in acc.Tags()["images"], acc.Tags()["images"]
    events = acc.Images(tag)
    assert len(events) == count, (len(events), count)
    for ev in events:
        assert ev.encoded_image_string.startswith(b"\x89PNG\r\n\x1a\n"), ev.encoded_image_string[:8]
        # The PNG header's own size (IHDR) is what the event says.
        w, h = int.from_bytes(ev.encoded_image_string[16:20], "big"), int.from_bytes(ev.encoded_image_string[20:24], "big")
        assert (ev.width, ev.height) == (w, h) and w > 100 and h > 100, (ev.width, ev.height, w, h)
    with open(os.path.join(run_dir, tag + ".png"), "rb") as f:
        assert f.read() == events[-1].encoded_image_string, "the run folder's PNG is not the last image logged"


if __name__ == "__main__":
    if sys.argv[1] == "match":
        match(sys.argv[2], "--histograms" in sys.argv)
    elif sys.argv[1] == "images":
        images(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "same":
        same(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: tb_check.py match RUN_DIR [--histograms] | same RUN_A RUN_B | images RUN_DIR TAG N")
