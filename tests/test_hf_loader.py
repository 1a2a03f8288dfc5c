"""The Hugging Face loader, run on a dataset built here (nothing is downloaded)."""

import numpy as np
from PIL import Image

from fedswarm.tasks.hf import HFImageSpec, load_hf_images


def test_hf_loader_on_local_parquet(tmp_path):
    from datasets import Dataset, Features, Image as HFImage, Value

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (28, 28), dtype=np.uint8)) for _ in range(40)]
    labels = [i % 10 for i in range(40)]
    ds = Dataset.from_dict({"image": images, "label": labels},
                           features=Features({"image": HFImage(), "label": Value("int64")}))
    path = tmp_path / "train.parquet"
    ds.to_parquet(str(path))
    spec = HFImageSpec("parquet", "image", "label", 1, 28, 10)
    data = load_hf_images(spec, seed=0, test_fraction=0.25, data_files={"train": str(path)})
    assert data.train_x.shape == (30, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
    assert 0.0 <= data.train_x.min() and data.train_x.max() <= 1.0
    # pixel values survive the trip: every original image is among the loaded ones
    first = np.asarray(images[0], dtype=np.float32) / 255.0
    all_x = np.concatenate([data.train_x.numpy(), data.test_x.numpy()])[:, 0]
    assert np.isclose(all_x, first, atol=1e-6).all(axis=(1, 2)).any()
    assert sorted(np.concatenate([data.train_y.numpy(), data.test_y.numpy()]).tolist()) == sorted(labels)


def test_hf_loader_names_missing_column(tmp_path):
    import pytest
    from datasets import Dataset

    Dataset.from_dict({"pixels": [[0] * 4], "label": [1]}).to_parquet(str(tmp_path / "t.parquet"))
    spec = HFImageSpec("parquet", "image", "label", 1, 2, 10)
    with pytest.raises(ValueError, match="no column 'image'"):
        load_hf_images(spec, 0, 0.5, data_files={"train": str(tmp_path / "t.parquet")})
