"""`qlm data preprocess`: text / jsonl / parquet -> Megatron indexed dataset (.bin/.idx)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from qlm_cli.render import console, progress_bar

app = typer.Typer(help="Prepare training data.", no_args_is_help=True)


@app.command("preprocess")
def preprocess(
    input: Annotated[list[Path], typer.Option("--input", help="Input files: .jsonl/.json (one document per record), "
                                              ".parquet (per row) or .txt (one document per blank-line-separated "
                                              "paragraph). Repeatable.")],
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="Directory of an HF tokenizer.")],
    output: Annotated[Path, typer.Option("--output", help="Output prefix: writes PREFIX.bin and PREFIX.idx.")],
    json_key: Annotated[str, typer.Option("--json-key", help="The text field of json/jsonl/parquet records.")] = "text",
    append_eod: Annotated[bool, typer.Option(
        "--append-eod", help="End every document with the tokenizer's eos.")] = False,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Tokenising processes (datasets' num_proc).")] = 1,
):
    """Tokenise documents into a Megatron indexed dataset that megatron-core's IndexedDataset reads."""
    from qlm_core.data.preprocess import preprocess as run_preprocess

    with progress_bar("preprocess") as progress:
        stats = run_preprocess(
            [str(p) for p in input], tokenizer, output, json_key=json_key, append_eod=append_eod, workers=workers,
            progress=lambda done, total: progress(done, total, "documents"),
        )
    console.print(
        f"[green]wrote[/] {escape(str(stats.output_prefix))}.bin/.idx: {stats.documents:,} documents, "
        f"{stats.tokens:,} tokens in {stats.seconds:.1f} s ({stats.tokens_per_second:,.0f} tokens/s)"
    )
