"""Problems from a dataset: JSONL, Parquet or CSV files, a Hugging Face `datasets` folder,
or a hub name.

    data_path = "mine.jsonl"    # one JSON object per line
    data_path = "mine.parquet"  # or mine.csv (cells are strings; one holding a JSON list is a list)
    data_path = "data/gsm8k"    # a folder: load_dataset's layout (train/test files), save_to_disk's
    data_path = "openai/gsm8k"  # a hub name, when online (data_name = "main" picks its config)

Each row becomes one problem dict: its columns, renamed by the task's COLUMNS and then by the
data_columns setting ("question:prompt,solution:answer"), plus an "id" (the row's own, or
file:row). The splits are the dataset's own when it has train and test (or validation) splits,
else a fixed 10% of the rows by a hash of their content (data/split.py), so the two never overlap.
"""

import csv
import io
import json
import os

from data.split import in_split

FILE_KINDS = (".jsonl", ".parquet", ".csv")
TEST_SPLITS = ("test", "validation")  # a dataset's own held-out split, in order of preference


class DataError(ValueError):
    """A dataset that cannot become problems; the message names the file,
    the row and what to change."""


def is_data_path(path):
    """True if `path` names a data file of a kind read here, or a folder."""
    return path.endswith(FILE_KINDS) or os.path.isdir(path)


def read_text(path):
    """The file's text; a byte that is not UTF-8 (a binary file, another encoding) is an error
    naming its line."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise DataError(f"{path}, line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
                        f"column {column}); a binary file? Save the rows as UTF-8 text") from None


def read_jsonl(path):
    """The rows of a JSONL file, each with its line number;
    a malformed line is an error naming it."""
    rows = []
    for lineno, line in enumerate(read_text(path).split("\n"), 1):  # JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}, line {lineno}: not valid JSON "
                            f"({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}, line {lineno}: JSON nested too deeply to read") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}, line {lineno}: expected a JSON object like "
                            '{"prompt": ..., ...}')
        rows.append((lineno, row))
    return rows


def read_csv(path):
    """The rows of a CSV file with a header line; a cell holding a JSON list
    (a code task's tests) becomes the list."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    rows, lineno = [], 1
    try:
        header = next(reader, [])
        lineno = reader.line_num + 1  # where the next row starts (a quoted cell may span lines)
        for cells in reader:
            if cells and len(cells) != len(header):
                raise DataError(f"{path}, line {lineno}: the header names {len(header)} columns, "
                                f"this row has {len(cells)} cells; quote a cell that holds a comma")
            if cells:
                row = {key: json_list(cell, path, lineno) for key, cell in zip(header, cells)}
                rows.append((lineno, row))
            lineno = reader.line_num + 1
    except csv.Error as e:  # e.g. a cell over csv's field limit of 128 KB
        raise DataError(f"{path}, line {lineno}: {e}; long cells fit in .jsonl or .parquet "
                        "files") from None
    return rows


def json_list(cell, path, lineno):
    """A cell that holds a JSON list, as the list; any other cell as it is."""
    if not cell.startswith("["):
        return cell
    try:
        return json.loads(cell)
    except json.JSONDecodeError:
        return cell  # a string that starts with "[", not a list
    except RecursionError:
        raise DataError(f"{path}, line {lineno}: a cell's JSON is nested too deeply to "
                        "read") from None


def read_datasets(path, name):
    """{split: rows} from a `datasets` folder
    (save_to_disk's or load_dataset's layout) or a hub name."""
    import datasets

    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                   for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(path)
    elif os.path.isdir(path):
        loaded = datasets.load_dataset(path, name or None)
    else:
        from infra.model_files import hub_reachable

        if not hub_reachable():
            raise DataError(f"data_path={path!r} is not a file or folder here, and the hub cannot "
                            "be reached to fetch it as a dataset; download it on a machine with "
                            "internet (datasets' save_to_disk, or the hub's parquet files) and "
                            "point data_path at the folder")
        try:
            loaded = datasets.load_dataset(path, name or None)
        except Exception as e:
            # not on the hub, a gated dataset, a wrong data_name: say which setting
            why = f"{type(e).__name__}: {e}"
            raise DataError(f"data_path={path!r}, data_name={name!r}: {why}") from None
    if isinstance(loaded, datasets.Dataset):
        return {"all": [(i + 1, row) for i, row in enumerate(loaded)]}
    return {split: [(i + 1, row) for i, row in enumerate(ds)] for split, ds in loaded.items()}


def read_splits(path, name=""):
    """{split: [(row number, row dict)]}: the dataset's own splits, or everything under "all"."""
    if path.endswith(".jsonl"):
        return {"all": read_jsonl(path)}
    if path.endswith(".csv"):
        return {"all": read_csv(path)}
    if path.endswith(".parquet"):
        import pyarrow.parquet

        rows = pyarrow.parquet.read_table(path).to_pylist()
        return {"all": [(i + 1, row) for i, row in enumerate(rows)]}
    if not os.path.isdir(path):
        return read_datasets(path, name)
    try:
        return read_datasets(path, name)
    except Exception as e:  # an empty or half-copied folder fails deep in datasets or pyarrow
        raise DataError(f"data_path={path!r}: cannot read this folder as a dataset "
                        f"({type(e).__name__}: {e}); it must hold save_to_disk's files, or data "
                        "files (.parquet, .jsonl, .csv) in load_dataset's layout; copy it again "
                        "whole") from None


def rows_of_split(splits, split):
    """The rows of `split` ("train" or "test"): the dataset's own split when it has both, else a
    hash split of all. "eval" (an eval_tasks set): the dataset's own test split, else every row."""
    test = next((s for s in TEST_SPLITS if s in splits), None)
    if split == "eval":
        return splits[test] if test else [r for part in splits.values() for r in part]
    if "train" in splits and test:
        return splits["train" if split == "train" else test]
    rows = [r for part in splits.values() for r in part]  # one file, or a dataset with one split
    return [(n, row) for n, row in rows
            if in_split(json.dumps(row, sort_keys=True, default=str), split)]


def renamed(row, columns):
    """The row with its columns renamed by `columns` ({old: new});
    a missing old column is an error."""
    missing = [old for old in columns if old not in row]
    if missing:
        raise DataError(f"no column {missing[0]!r} to rename (the row has {sorted(row)})")
    return {columns.get(k, k): v for k, v in row.items()}


def load_rows(path, split, n, columns, check=None, name=""):
    """The first n problems of `split` from the dataset at `path`, renamed by `columns`,
    each checked by check()."""
    if not os.path.exists(path) and (path.startswith((".", "/", "~")) or path.endswith(FILE_KINDS)):
        raise DataError(f"data_path={path!r} not found")
    problems = []
    for number, row in rows_of_split(read_splits(path, name), split)[:n]:
        where = f"{path}, {'line' if path.endswith(('.jsonl', '.csv')) else 'row'} {number}"
        try:
            problem = renamed(row, columns)
            problem.setdefault("id", f"{os.path.basename(path)}:{number}")
            problem["id"] = str(problem["id"])
            if check is not None:
                check(problem)  # the task's own check: raises ValueError saying what the row lacks
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: {e}") from None
        problems.append(problem)
    if not problems:
        raise DataError(f"{path}: no {split} problems (without its own test split, ~10% of rows "
                        "are the test split; add more rows)")
    return problems
