"""docs/copying.md's recipe for random augmentation in loader workers keeps exact resume: each row's draws come
from the epoch's seed and the row, so neither the number of workers nor a resume at an odd step changes them."""
import re

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from helpers import ROOT

PAGE = ROOT / "docs" / "copying.md"


def recipe():
    """The page's Augmented class, as a copier pastes it."""
    code = re.search(r"<!-- recipe: augmentation -->\n```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    namespace = dict(torch=torch, F=F, Dataset=Dataset)
    exec(code, namespace)
    return namespace["Augmented"]


ROWS = [(torch.randn(1, 28, 28, generator=torch.Generator().manual_seed(r)), r) for r in range(12)]
ORDER = [7, 2, 9, 4, 0, 11, 5, 1, 8, 3, 10, 6]  # one epoch's shuffle


def images(dataset, order, workers, epoch=1):
    dataset.epoch = epoch
    loader = DataLoader(dataset, batch_size=2, sampler=order, num_workers=workers,
                        generator=torch.Generator().manual_seed(epoch))  # the scripts' seeded loaders
    return [batch[0] for batch in loader]


def test_augmented_rows_are_the_same_in_any_worker_and_after_a_resume_at_an_odd_step():
    dataset = recipe()(ROWS, seed=0)
    whole = images(dataset, ORDER, workers=0)
    assert not torch.equal(whole[0][0], ROWS[ORDER[0]][0])  # it augments
    assert all(map(torch.equal, images(dataset, ORDER, workers=2), whole))
    resumed = images(dataset, ORDER[2 * 3:], workers=2)  # from step 3: batch 3 now comes from worker 0, not 1
    assert all(map(torch.equal, resumed, whole[3:]))
    assert not torch.equal(images(dataset, ORDER, workers=0, epoch=2)[0], whole[0])  # each epoch draws anew


def test_the_control_a_transform_drawing_from_its_worker_does_not_resume():
    """The mistake the recipe avoids: the same shift drawn from the worker's own RNG."""
    class FromTheWorker(recipe()):
        def __getitem__(self, i):
            image, label = self.rows[i]
            dy, dx = torch.randint(0, 5, (2,)).tolist()  # the worker's RNG, seeded from the loader's base seed
            return F.pad(image, (2, 2, 2, 2))[..., dy:dy + 28, dx:dx + 28], label

    dataset = FromTheWorker(ROWS, seed=0)
    whole = images(dataset, ORDER, workers=2)
    resumed = images(dataset, ORDER[2 * 3:], workers=2)
    assert not all(map(torch.equal, resumed, whole[3:]))
