//! Argument checks shared by every backend: each op validates its shapes here, before any work (and,
//! on devices, before any `unsafe` launch), so that all backends reject the same inputs with the same
//! messages.

use super::{AttnShape, PagedSeq};
use crate::error::{Error, Result};

/// The error of a malformed op call.
pub(crate) fn shape_err(op: &str, msg: String) -> Error {
    Error::Shape {
        op: op.to_string(),
        message: msg,
    }
}

/// `rms_norm` over groups of `g` columns of `cols`: `g`, when it is non-zero and divides them.
pub(crate) fn rms_norm_groups(cols: usize, g: usize) -> Result<usize> {
    if g == 0 || !cols.is_multiple_of(g) {
        return Err(shape_err("rms_norm", format!("{cols} columns, weight of {g}")));
    }
    Ok(g)
}

/// `rope` of `x` with tables `cos` and `sin`, both `[x rows, d]` with `d` even and dividing `x`'s
/// columns: `d`.
pub(crate) fn rope(x: (usize, usize), cos: (usize, usize), sin: (usize, usize)) -> Result<usize> {
    same("rope", cos, sin)?;
    let d = cos.1;
    if cos.0 != x.0 || d == 0 || !d.is_multiple_of(2) || !x.1.is_multiple_of(d) {
        return Err(shape_err(
            "rope",
            format!("x [{}, {}] with tables [{}, {d}]", x.0, x.1, cos.0),
        ));
    }
    Ok(d)
}

/// `paged_attention`: q `[Σ rows, q_heads · d]`, pools `[slots, kv_heads · d]`, and every sequence's
/// block table inside the pool and long enough for its context.
pub(crate) fn paged_attention(
    q: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    s: AttnShape,
    seqs: &[PagedSeq<'_>],
) -> Result<()> {
    let rows: usize = seqs.iter().map(|x| x.rows).sum();
    let ok = s.kv_heads > 0
        && s.block_size > 0
        && s.q_heads.is_multiple_of(s.kv_heads)
        && q.1 == s.q_heads * s.head_dim
        && k.1 == s.kv_heads * s.head_dim
        && k == v
        && rows == q.0
        && seqs.iter().all(|x| {
            x.rows <= x.context_len
                && x.block_table.len() * s.block_size >= x.context_len
                && x.block_table
                    .iter()
                    .all(|&b| (b as usize + 1) * s.block_size <= k.0)
        });
    if ok {
        Ok(())
    } else {
        Err(shape_err(
            "paged_attention",
            format!(
                "q [{}, {}], pool [{}, {}], {s:?}, {} sequences",
                q.0,
                q.1,
                k.0,
                k.1,
                seqs.len()
            ),
        ))
    }
}

/// `scatter_rows`: `src [index.len(), cols]` into rows of `dst [rows, cols]` that exist.
pub(crate) fn scatter_rows(dst: (usize, usize), index: &[usize], src: (usize, usize)) -> Result<()> {
    if src.1 != dst.1 || src.0 != index.len() || index.iter().any(|&i| i >= dst.0) {
        return Err(shape_err(
            "scatter_rows",
            format!(
                "[{}, {}] at {} rows into [{}, {}]",
                src.0,
                src.1,
                index.len(),
                dst.0,
                dst.1
            ),
        ));
    }
    Ok(())
}

/// `linear`: a 2-D weight `[out, in]` matching the input's columns, and a bias of `out` values.
/// Returns `out`.
pub(crate) fn linear(x_cols: usize, w_shape: &[usize], bias_shape: Option<&[usize]>) -> Result<usize> {
    let (out, inner) = match w_shape {
        [o, i] => (*o, *i),
        _ => return Err(shape_err("linear", format!("weight of shape {w_shape:?}"))),
    };
    if x_cols != inner {
        return Err(shape_err(
            "linear",
            format!("input has {x_cols} columns, weight {w_shape:?}"),
        ));
    }
    if let Some(b) = bias_shape.filter(|b| b.iter().product::<usize>() != out) {
        return Err(shape_err(
            "linear",
            format!("bias of shape {b:?} for {out} outputs"),
        ));
    }
    Ok(out)
}

/// `attention_segments`: q, k, v of one shape, heads dividing the columns, and `cu_seqlens` rising
/// from 0 to the row count.
pub(crate) fn attention_segments(
    q: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    heads: usize,
    cu_seqlens: &[usize],
) -> Result<()> {
    let monotone = cu_seqlens.windows(2).all(|w| w[0] <= w[1]);
    if q != k
        || q != v
        || heads == 0
        || !q.1.is_multiple_of(heads)
        || cu_seqlens.first() != Some(&0)
        || cu_seqlens.last() != Some(&q.0)
        || !monotone
    {
        return Err(shape_err(
            "attention_segments",
            format!(
                "q [{}, {}], k {k:?}, v {v:?}, {heads} heads, cu_seqlens {cu_seqlens:?}",
                q.0, q.1
            ),
        ));
    }
    Ok(())
}

/// `reshape`: the element count is kept.
pub(crate) fn reshape(from: (usize, usize), rows: usize, cols: usize) -> Result<()> {
    if rows * cols != from.0 * from.1 {
        return Err(shape_err(
            "reshape",
            format!("[{}, {}] to [{rows}, {cols}]", from.0, from.1),
        ));
    }
    Ok(())
}

/// `split_cols`: the columns divide into `parts` equal parts; their width.
pub(crate) fn split_cols((rows, cols): (usize, usize), parts: usize) -> Result<usize> {
    if parts == 0 || !cols.is_multiple_of(parts) {
        return Err(shape_err(
            "split_cols",
            format!("[{rows}, {cols}] into {parts} parts"),
        ));
    }
    Ok(cols / parts)
}

/// Elementwise ops: both operands have one shape.
pub(crate) fn same(op: &str, a: (usize, usize), b: (usize, usize)) -> Result<()> {
    if a != b {
        return Err(shape_err(
            op,
            format!("shapes [{}, {}] and [{}, {}] differ", a.0, a.1, b.0, b.1),
        ));
    }
    Ok(())
}

/// `weighted_embedding`: `taps` index/weight pairs per output row, every index inside the table.
pub(crate) fn weighted_embedding(
    table_shape: &[usize],
    indices: &[u32],
    weights: &[f32],
    taps: usize,
) -> Result<()> {
    let vocab = *table_shape.first().unwrap_or(&0);
    if taps == 0
        || indices.len() != weights.len()
        || !indices.len().is_multiple_of(taps)
        || indices.iter().any(|&i| i as usize >= vocab)
    {
        return Err(shape_err(
            "weighted_embedding",
            format!(
                "{} indices, {} weights, {taps} taps, table {table_shape:?}",
                indices.len(),
                weights.len()
            ),
        ));
    }
    Ok(())
}
