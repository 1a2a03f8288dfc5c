"""A node's own dataset: every format gives the tensors the task trains on (oracle: digits / 16,
8-bit pixels / 255), bad data is refused in one line naming the file, a few unreadable images
are skipped and counted, the validation split is seeded and disjoint, and every engine trains
each client on its own data (the batched engine to the in-process engine's models)."""

import itertools

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedswarm.config import RunConfig
from fedswarm.tasks import get_task
from fedswarm.tasks.localdata import LocalDataError, LocalDataSpec, load_local, read_examples, split_local
from fedswarm.train import local_validation, partition_data, trainer_for
from tests.localdata_helpers import (digits, image_folder_order, pixels, write_csv, write_image_folder, write_npz,
                                     write_parquet)

ROWS = get_task("digits-mlp").examples
IMAGES = get_task("digits-cnn").examples


def _read(path, spec=ROWS, label_column="label"):
    x, y, skipped = read_examples(path, spec, label_column)
    return x.numpy(), y.numpy(), skipped


def test_npz_csv_parquet_give_the_digits_rows(tmp_path):
    x, y = digits(slice(0, 40))
    for path in (write_npz(tmp_path / "d.npz", x, y), write_csv(tmp_path / "d.csv", x, y),
                 write_parquet(tmp_path / "d.parquet", x, y)):
        gx, gy, skipped = _read(path)
        assert np.array_equal(gx, x) and np.array_equal(gy, y) and skipped == 0, path
    gx, gy, _ = _read(write_csv(tmp_path / "t.csv", x, y, label_column="target"), label_column="target")
    assert np.array_equal(gx, x) and np.array_equal(gy, y)


def test_eight_bit_arrays_and_images_are_divided_by_255(tmp_path):
    x, y = digits(slice(0, 30))
    px = pixels(x)
    gx, gy, _ = _read(write_npz(tmp_path / "u8.npz", px.reshape(-1, 8, 8), y), IMAGES)
    assert gx.shape == (30, 1, 8, 8)
    assert np.array_equal(gx.reshape(30, 64), px.astype(np.float32) / np.float32(255)) and np.array_equal(gy, y)
    order = image_folder_order(y)
    gx, gy, skipped = _read(write_image_folder(tmp_path / "img", x, y))
    assert np.array_equal(gx, px[order].astype(np.float32) / np.float32(255))
    assert np.array_equal(gy, y[order]) and skipped == 0


def test_hugging_face_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    x, y = digits(slice(0, 20))
    datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()}).save_to_disk(str(tmp_path / "hf"))
    gx, gy, _ = _read(tmp_path / "hf")
    assert np.array_equal(gx, x) and np.array_equal(gy, y)
    imgs = [__import__("PIL.Image").Image.fromarray(p.reshape(8, 8), mode="L") for p in pixels(x)]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.Dataset.from_dict({"image": imgs, "label": y.tolist()}, features=feats).save_to_disk(str(tmp_path / "hi"))
    gx, gy, _ = _read(tmp_path / "hi", IMAGES)
    assert np.array_equal(gx.reshape(20, 64), pixels(x).astype(np.float32) / np.float32(255))


@pytest.mark.parametrize("case, message", [
    ("raw-scale", "outside the task's [0, 1]"),
    ("shape", "examples have shape (63,), the task takes (64,) or (8, 8) or (1, 8, 8)"),
    ("label", "label 10 of example 3 is outside the task's classes 0..9"),
    ("float-label", "labels have dtype float64"),
    ("nan", "example 2 has a value that is not finite"),
    ("strings", "examples have dtype <U1"),
    ("no-y", "no array y"),
    ("empty", "holds no examples"),
    ("not-npz", "cannot read as .npz"),
])
def test_bad_npz_is_refused_in_one_line(case, message, tmp_path):
    x, y = digits(slice(0, 10))
    path = tmp_path / "bad.npz"
    if case == "raw-scale":
        write_npz(path, x * 16, y)
    elif case == "shape":
        write_npz(path, x[:, :63], y)
    elif case == "label":
        y[3] = 10
        write_npz(path, x, y)
    elif case == "float-label":
        write_npz(path, x, y + 0.5)
    elif case == "nan":
        x[2, 5] = np.nan
        write_npz(path, x, y)
    elif case == "strings":
        write_npz(path, np.full((10, 64), "a"), y)
    elif case == "no-y":
        np.savez(path, x=x)
    elif case == "empty":
        write_npz(path, x[:0], y[:0])
    else:
        path.write_bytes(b"not a zip file")
    with pytest.raises(LocalDataError) as err:
        read_examples(path, ROWS)
    text = str(err.value)
    assert message in text and text.startswith(str(path)) and "\n" not in text


def test_bad_tables_and_folders_are_refused(tmp_path):
    x, y = digits(slice(0, 10))
    cases = []
    p = write_csv(tmp_path / "a.csv", x, y)
    lines = p.read_text().splitlines()
    fields = lines[5].split(",")
    fields[7] = "oops"
    lines[5] = ",".join(fields)
    p.write_text("\n".join(lines) + "\n")
    cases.append((p, "line 6: 'oops' in column 'p7' is not a number"))
    cases.append((write_csv(tmp_path / "b.csv", x, y, label_column="target"), "no label column 'label'"))
    (tmp_path / "c.csv").write_bytes(b"\xff\xfe\x00bad")
    cases.append((tmp_path / "c.csv", "cannot read as CSV"))
    (tmp_path / "d.parquet").write_bytes(b"PAR1 nonsense")
    cases.append((tmp_path / "d.parquet", "cannot read as Parquet"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "holds no examples"))
    (tmp_path / "cats" / "cat").mkdir(parents=True)
    cases.append((tmp_path / "cats", "folder name is not a class of the task"))
    cases.append((tmp_path / "none.npz", "no such file or folder"))
    (tmp_path / "e.txt").write_text("x")
    cases.append((tmp_path / "e.txt", "unknown format"))
    for path, message in cases:
        with pytest.raises(LocalDataError) as err:
            read_examples(path, ROWS)
        assert message in str(err.value) and "\n" not in str(err.value), (path, str(err.value))


def test_a_few_unreadable_images_are_skipped_and_counted_many_refuse(tmp_path):
    x, y = digits(slice(0, 20))
    root = write_image_folder(tmp_path / "img", x, y)
    first = sorted((root / str(int(y[0]))).iterdir())[0]
    first.write_bytes(b"\x89PNG broken")
    gx, gy, skipped = _read(root)
    assert skipped == 1 and len(gy) == 19
    kept = np.array([i for i in image_folder_order(y) if i != 0])
    assert np.array_equal(gy, y[kept]) and np.array_equal(gx, pixels(x)[kept].astype(np.float32) / np.float32(255))
    # a 16x16 image is as unusable as a corrupt one; three of twenty is more than a tenth: refused
    from PIL import Image

    for name in ("big1.png", "big2.png"):
        Image.new("L", (16, 16)).save(root / "3" / name)
    with pytest.raises(LocalDataError,
                       match=r"img: 3 of 22 images cannot be used \(first: \S+/00000.png: cannot identify image"):
        read_examples(root, ROWS)


def test_validation_split_is_seeded_disjoint_and_refused_when_empty(tmp_path):
    tr, va = split_local(50, 0.2, seed=3, where="d")
    assert len(va) == 10 and len(tr) == 40
    assert sorted(torch.cat([tr, va]).tolist()) == list(range(50))  # disjoint and complete
    tr2, va2 = split_local(50, 0.2, seed=3, where="d")
    assert torch.equal(va, va2) and torch.equal(tr, tr2)
    assert not torch.equal(va, split_local(50, 0.2, seed=4, where="d")[1])
    with pytest.raises(LocalDataError, match="d: 2 examples leave an empty validation split at --val-fraction 0.2"):
        split_local(2, 0.2, seed=0, where="d")
    with pytest.raises(LocalDataError, match="leave no training examples"):
        split_local(1, 0.6, seed=0, where="d")


def _client_dir(tmp_path):
    """Three clients with class skews, in three formats (sorted names give the order)."""
    root = tmp_path / "clients"
    root.mkdir()
    data, target = digits(slice(0, 600))
    skews = [np.flatnonzero(target < 4)[:90], np.flatnonzero(target >= 4)[:130], np.arange(500, 560)]
    write_npz(root / "a.npz", data[skews[0]], target[skews[0]])
    write_image_folder(root / "b-images", data[skews[1]], target[skews[1]])
    write_csv(root / "c.csv", data[skews[2]], target[skews[2]])
    return root, [len(s) for s in skews]


def test_trainer_and_validation_use_the_clients_own_split(tmp_path):
    root, sizes = _client_dir(tmp_path)
    cfg = RunConfig(client_data=str(root), clients=3, seed=7)
    for k, n in enumerate(sizes):
        vx, vy = local_validation(cfg, k)
        tx, ty = partition_data(cfg, k, 3)
        assert len(vy) == round(0.2 * n) and len(ty) == n - len(vy)
        assert trainer_for(cfg, k, 3).num_examples == len(ty)
        # train and validation are the client's examples, disjoint: together all of them, once
        every = read_examples(sorted(root.iterdir())[k], ROWS)[0]
        both = torch.cat([tx, vx])
        assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, every.tolist()))
    assert set(partition_data(cfg, 0, 3)[1].tolist()) <= {0, 1, 2, 3}  # the skew is the client's own
    assert local_validation(RunConfig(), 0) is None  # no local data: the other rule applies


def test_client_app_reports_skipped_examples_and_fails_cleanly_later(tmp_path):
    from fedswarm.client.app import train
    from fedswarm.params import get_flat
    from fedswarm.wire import vector_to_arrayrecord

    x, y = digits(slice(0, 40))
    root = write_image_folder(tmp_path / "img", x, y)
    sorted((root / str(int(y[0]))).iterdir())[0].write_bytes(b"broken")
    local = LocalDataSpec(str(root))
    expected = len(load_local("digits-mlp", local, 0).train_y)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        ctx = Context(run_id=1, node_id=3, node_config={"data-path": str(root), "val-fraction": 0.2},
                      state=RecordDict(), run_config={"task": "digits-mlp", "local_steps": 1, "seed": 0})
        flat = get_flat(get_task("digits-mlp").model(0))
        msg = Message(RecordDict({"arrays": vector_to_arrayrecord(flat),
                                  "config": ConfigRecord({"server-round": 1})}), dst_node_id=3, message_type="train")
        metrics = train(msg, ctx).content.metric_records["metrics"]
        assert metrics["skipped_examples"] == 1 and metrics["num-examples"] == expected == 31
        # the data turns bad between rounds: the next ClientApp process refuses it in one line
        import fedswarm.tasks.localdata as localdata
        import fedswarm.train as train_mod

        localdata._load_local.cache_clear()
        train_mod._trainer.cache_clear()
        for f in itertools.islice(root.rglob("*.png"), 10):
            f.write_bytes(b"broken")
        with pytest.raises(LocalDataError, match=r"^\S+/img: 11 of 40 images cannot be used"):
            train(msg, ctx)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def test_batched_gives_the_inprocess_models_with_client_data(tmp_path, monkeypatch):
    from tests.test_batched import same_models_on_both_engines

    root, sizes = _client_dir(tmp_path)
    kw = dict(client_data=str(root), clients=3, rounds=2, local_epochs=1, seed=1)
    _, got, pairs = same_models_on_both_engines(kw, tmp_path, monkeypatch)
    for r_ref, r_got in pairs:
        assert r_got["train_loss"] == pytest.approx(r_ref["train_loss"], abs=1e-5)
        assert r_got["bytes_up"] == r_ref["bytes_up"]


def test_sim_clients_default_to_the_datasets_and_a_mismatch_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from fedswarm.cli import app
    from fedswarm.cli.simulation import _client_data_clients
    from fedswarm.errors import ConfigError

    root, _ = _client_dir(tmp_path)
    values = {"client_data": str(root)}
    _client_data_clients(values)
    assert values["clients"] == 3
    with pytest.raises(ConfigError, match="5 clients but --client-data .* holds 3 datasets"):
        _client_data_clients({"client_data": str(root), "clients": 5})
    with pytest.raises(ConfigError, match="'dirichlet:0.5' splits the task's own data"):
        _client_data_clients({"client_data": str(root), "partition": "dirichlet:0.5"})
    (root / "notes.txt").write_text("x")
    res = CliRunner().invoke(app, ["sim", "--client-data", str(root), "--rounds", "1"])
    assert res.exit_code == 2 and "notes.txt: not a dataset" in res.output


def test_swarm_peer_trains_on_its_own_data(tmp_path):
    from fedswarm.swarm.peer import Peer, PeerConfig

    x, y = digits(slice(0, 50))
    path = write_npz(tmp_path / "mine.npz", x, y)
    cfg = PeerConfig(data_path=str(path), val_fraction=0.1, insecure_allow_any=True, rounds=1, local_steps=2,
                     linger_s=0.0, state_dir=str(tmp_path / "peer"))
    peer = Peer(cfg)
    split = load_local("digits-mlp", cfg.local_data(), cfg.seed)
    assert peer.trainer.num_examples == 45 and torch.equal(peer.trainer.x, split.train_x)
    assert peer.run()["rounds_done"] == 1


def test_a_tasks_own_reader_is_used_and_checked(tmp_path):
    from dataclasses import replace

    x, y = digits(slice(0, 12))
    (tmp_path / "mine.bin").write_bytes(b"anything the reader understands")
    calls = []

    def reader(path, label_column):
        calls.append((path.name, label_column))
        return x.reshape(12, 8, 8), y

    spec = replace(ROWS, reader=reader)
    gx, gy, _ = _read(tmp_path / "mine.bin", spec, "digit")
    assert calls == [("mine.bin", "digit")] and np.array_equal(gx, x) and np.array_equal(gy, y)
    with pytest.raises(LocalDataError, match="examples have shape"):  # its arrays are checked like any other
        read_examples(tmp_path / "mine.bin", replace(ROWS, reader=lambda p, c: (x[:, :10], y)))
    with pytest.raises(LocalDataError, match=r"mine.bin: the task's reader failed \(no such sensor\)$"):
        read_examples(tmp_path / "mine.bin", replace(ROWS, reader=lambda p, c: (_ for _ in ()).throw(OSError(
            "no such sensor"))))


def test_a_missing_optional_package_is_named_in_one_line(tmp_path, monkeypatch):
    import sys

    x, y = digits(slice(0, 10))
    paths = {"PIL": write_image_folder(tmp_path / "img", x, y), "pyarrow": write_parquet(tmp_path / "d.parquet", x, y)}
    for module in ("PIL.Image", "pyarrow.parquet", "datasets"):  # None in sys.modules: the import fails
        monkeypatch.setitem(sys.modules, module, None)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_info.json").write_text("{}")
    for package, what, path in (("pillow", "images", paths["PIL"]), ("pyarrow", "Parquet", paths["pyarrow"]),
                                ("datasets", "a saved Hugging Face dataset", tmp_path / "hf")):
        with pytest.raises(LocalDataError) as err:
            read_examples(path, ROWS)
        assert str(err.value) == f"{path}: reading {what} needs the {package} package (pip install {package})"
