//! Python's operators for chat templates. minijinja compiles `x[k]`, `x[a:b:c]`, `<`,
//! `<=`, `>`, `>=`, `in`, `~` and the arithmetic operators to instructions whose
//! semantics are its own; Jinja2 runs them as Python does, and the differences change
//! what a template prints or whether it raises:
//!
//! - an undefined value raises (`UndefinedError`) when subscripted, sliced, compared or
//!   used in arithmetic (minijinja hands back an empty value, `false` or `0`);
//! - a comparison, `in` or arithmetic across types raises Python's `TypeError`
//!   (`None < 1`, `1 in "text"`, a list as a dict key, `'a' + 1`) where minijinja
//!   answers; dividing by zero (or `false`) raises `ZeroDivisionError`;
//! - a slice is Python's: a reversed slice of an empty string or list is empty
//!   (minijinja 2.x panics), slicing a number, boolean, None, dict or generator raises
//!   (a subscript of them gives an undefined value: Jinja2's `getitem` swallows that
//!   `TypeError`, its slices do not);
//! - `~` joins Python's `str()` of each side (`'a' ~ none` is `aNone`, a list prints as
//!   its repr), `*` repeats a string or list by an integer or boolean, booleans are
//!   integers (`-True` is `-1`), `//` and `%` floor as Python's do, `'%s' % x` formats,
//!   and `+` with a string marked safe (`'…' | safe`, Python's `Markup`) HTML-escapes the
//!   plain side.
//!
//! Python's own `TypeError` on a slice of a literal (`{{ false[1:] }}`) is swallowed
//! by Jinja2's constant folding, which evaluates literals at compile time; here it
//! raises as the same slice of a variable does.
//!
//! [`rewrite`] swaps each such instruction of a compiled template, one for one, for a
//! call to the function here that does what Python does; a call pops its arguments and
//! pushes its result exactly as the operator did, so no jump target moves. minijinja's
//! own operators cannot be called from outside the crate, so each function implements
//! the operation whole for the value kinds a JSON context and a template can make.

use std::cmp::Ordering;

use minijinja::machinery::{Instruction, Instructions};
use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use super::{filters, pyvalue};

/// minijinja's filter lookup slot (`compiler::instructions::LocalId`) and how many slots a
/// render has (`MAX_LOCALS`), which its machinery does not export: 2.24's values (the
/// lock file pins it). A slot past the real bound would index out of minijinja's array;
/// the render turns that panic into a refusal and the fidelity tests would show it.
type LocalId = u8;
const MAX_LOCALS: usize = 50;

const GETITEM: &str = "__kvroute_getitem";
const SLICE: &str = "__kvroute_slice";
const LT: &str = "__kvroute_lt";
const LTE: &str = "__kvroute_lte";
const GT: &str = "__kvroute_gt";
const GTE: &str = "__kvroute_gte";
const IN: &str = "__kvroute_in";
const CONCAT: &str = "__kvroute_concat";
const MUL: &str = "__kvroute_mul";
const NEG: &str = "__kvroute_neg";
const ADD: &str = "__kvroute_add";
const SUB: &str = "__kvroute_sub";
const DIV: &str = "__kvroute_div";
const FLOORDIV: &str = "__kvroute_floordiv";
const MOD: &str = "__kvroute_mod";
const POW: &str = "__kvroute_pow";

/// Registers the functions [`rewrite`] calls (names no template uses). They are filters,
/// not globals: the VM caches a filter's lookup per render in a local slot, where a
/// function call searches the context's frames on every call.
pub(super) fn add(env: &mut Environment<'static>) {
    env.add_filter(GETITEM, getitem);
    env.add_filter(SLICE, slice);
    env.add_filter(LT, |a: Value, b: Value| compare(&a, &b, Ordering::is_lt));
    env.add_filter(LTE, |a: Value, b: Value| compare(&a, &b, Ordering::is_le));
    env.add_filter(GT, |a: Value, b: Value| compare(&a, &b, Ordering::is_gt));
    env.add_filter(GTE, |a: Value, b: Value| compare(&a, &b, Ordering::is_ge));
    env.add_filter(IN, contains);
    env.add_filter(CONCAT, concat);
    env.add_filter(MUL, mul);
    env.add_filter(NEG, neg);
    env.add_filter(ADD, add_values);
    env.add_filter(SUB, |a: Value, b: Value| arith(&a, &b, Arith::Sub));
    env.add_filter(DIV, |a: Value, b: Value| arith(&a, &b, Arith::Div));
    env.add_filter(FLOORDIV, |a: Value, b: Value| {
        arith(&a, &b, Arith::FloorDiv)
    });
    env.add_filter(MOD, modulo);
    env.add_filter(POW, |a: Value, b: Value| arith(&a, &b, Arith::Pow));
}

/// Each operator instruction of `ins` replaced by the call that does it as Python does:
/// `ApplyFilter`, whose stack effect is the operator's (it pops its operands, pushes
/// one result). Each operator gets a lookup slot after those the compiler gave the
/// template's own filters (none past minijinja's 50: then it is looked up each time).
pub(super) fn rewrite(ins: &mut Instructions<'_>, first_slot: LocalId) {
    const OPS: [&str; 16] = [
        GETITEM, SLICE, LT, LTE, GT, GTE, IN, CONCAT, MUL, NEG, ADD, SUB, DIV, FLOORDIV, MOD, POW,
    ];
    let slot = |name: &str| {
        let at = OPS.iter().position(|o| *o == name).unwrap_or(usize::MAX);
        usize::from(first_slot)
            .checked_add(at)
            .filter(|s| *s < MAX_LOCALS)
            .map_or(!0, |s| s as LocalId)
    };
    let mut at = 0;
    while let Some(i) = ins.get_mut(at) {
        let call = match i {
            Instruction::GetItem => Some((GETITEM, 2)),
            Instruction::Slice => Some((SLICE, 4)),
            Instruction::Lt => Some((LT, 2)),
            Instruction::Lte => Some((LTE, 2)),
            Instruction::Gt => Some((GT, 2)),
            Instruction::Gte => Some((GTE, 2)),
            Instruction::In => Some((IN, 2)),
            Instruction::StringConcat => Some((CONCAT, 2)),
            Instruction::Mul => Some((MUL, 2)),
            Instruction::Neg => Some((NEG, 1)),
            Instruction::Add => Some((ADD, 2)),
            Instruction::Sub => Some((SUB, 2)),
            Instruction::Div => Some((DIV, 2)),
            Instruction::IntDiv => Some((FLOORDIV, 2)),
            Instruction::Rem => Some((MOD, 2)),
            Instruction::Pow => Some((POW, 2)),
            _ => None,
        };
        if let Some((name, args)) = call {
            *i = Instruction::ApplyFilter(name, Some(args), slot(name));
        }
        at += 1;
    }
}

/// The first filter lookup slot no `ApplyFilter` of `ins` uses.
pub(super) fn free_slot(ins: &Instructions<'_>) -> LocalId {
    let mut next = 0;
    let mut at = 0;
    while let Some(i) = ins.get(at) {
        if let Instruction::ApplyFilter(_, _, id) = i {
            if *id != !0 {
                next = next.max(id.saturating_add(1));
            }
        }
        at += 1;
    }
    next
}

/// What Jinja2's `Undefined` raises when used as a value.
pub(super) fn undefined_error() -> Error {
    Error::new(ErrorKind::UndefinedError, "undefined value")
}

fn type_error(msg: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg)
}

/// Python's name of a value's type, for error messages.
fn type_name(v: &Value) -> &'static str {
    match v.kind() {
        ValueKind::Undefined => "Undefined",
        ValueKind::None => "NoneType",
        ValueKind::Bool => "bool",
        ValueKind::Number if v.is_integer() => "int",
        ValueKind::Number => "float",
        ValueKind::String => "str",
        ValueKind::Seq => "list",
        ValueKind::Map => "dict",
        _ if filters::is_generator(v) => "generator",
        _ => "object",
    }
}

/// `obj[key]`: an undefined `obj` raises; a generator or dict view cannot be subscripted (Jinja2
/// swallows Python's `TypeError` into an undefined value); the rest is minijinja's
/// lookup, which is Python's for strings, lists and dicts.
fn getitem(obj: Value, key: Value) -> Result<Value, Error> {
    if filters::is_generator(&obj) || obj.downcast_object_ref::<pyvalue::DictView>().is_some() {
        return Ok(Value::UNDEFINED);
    }
    obj.get_item(&key)
}

/// A slice bound as Python takes it: `None` for none, an integer (booleans count),
/// `Err(())` for anything else (a `TypeError`).
fn bound(v: &Value) -> Result<Option<i128>, ()> {
    match v.kind() {
        ValueKind::None => Ok(None),
        ValueKind::Bool => Ok(Some(i128::from(v.is_true()))),
        ValueKind::Number if v.is_integer() => i128::try_from(v.clone()).map(Some).map_err(|_| ()),
        _ => Err(()),
    }
}

/// The indices `value[start:stop:step]` takes from a sequence of `len` (CPython's
/// `PySlice_AdjustIndices`).
fn slice_indices(len: usize, start: Option<i128>, stop: Option<i128>, step: i128) -> Vec<usize> {
    let n = len as i128;
    let (lower, upper) = if step > 0 { (0, n) } else { (-1, n - 1) };
    let clamp = |i: i128| {
        if i < 0 {
            i.saturating_add(n).max(lower)
        } else {
            i.min(upper)
        }
    };
    let start = start.map_or(if step > 0 { lower } else { upper }, clamp);
    let stop = stop.map_or(if step > 0 { upper } else { lower }, clamp);
    let mut out = Vec::new();
    let mut i = start;
    while (step > 0 && i < stop) || (step < 0 && i > stop) {
        out.push(i as usize);
        match i.checked_add(step) {
            Some(next) => i = next,
            None => break,
        }
    }
    out
}

/// `value[start:stop:step]` as Jinja2 evaluates it.
fn slice(value: Value, start: Value, stop: Value, step: Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Err(undefined_error());
    }
    let (Ok(start), Ok(stop), Ok(step)) = (bound(&start), bound(&stop), bound(&step)) else {
        return Err(type_error(
            "slice indices must be integers or None or have an __index__ method".into(),
        ));
    };
    let step = step.unwrap_or(1);
    if step == 0 {
        return Err(type_error("slice step cannot be zero".into()));
    }
    match value.kind() {
        ValueKind::String => {
            let chars: Vec<char> = value.as_str().unwrap_or_default().chars().collect();
            let picked = slice_indices(chars.len(), start, stop, step);
            Ok(Value::from(
                picked.into_iter().map(|i| chars[i]).collect::<String>(),
            ))
        }
        ValueKind::Seq if !filters::is_generator(&value) => {
            let items: Vec<Value> = value.try_iter()?.collect();
            let picked = slice_indices(items.len(), start, stop, step);
            Ok(Value::from(
                picked
                    .into_iter()
                    .map(|i| items[i].clone())
                    .collect::<Vec<_>>(),
            ))
        }
        ValueKind::Map => Err(type_error("unhashable type: 'slice'".into())),
        _ => Err(type_error(format!(
            "'{}' object is not subscriptable",
            type_name(&value)
        ))),
    }
}

/// A number as Python compares and multiplies it: booleans are integers.
enum Num {
    Int(i128),
    Float(f64),
}

fn num(v: &Value) -> Option<Num> {
    match v.kind() {
        ValueKind::Bool => Some(Num::Int(i128::from(v.is_true()))),
        ValueKind::Number if v.is_integer() => i128::try_from(v.clone()).ok().map(Num::Int),
        ValueKind::Number => f64::try_from(v.clone()).ok().map(Num::Float),
        _ => None,
    }
}

fn as_f64(n: &Num) -> f64 {
    match n {
        Num::Int(i) => *i as f64,
        Num::Float(f) => *f,
    }
}

/// Python's ordering of `a` and `b`: numbers with numbers, strings with strings (by code
/// point), lists item by item; `None` when Python raises `TypeError` (any other pair,
/// or a NaN, which orders as nothing).
fn py_cmp(a: &Value, b: &Value) -> Option<Ordering> {
    if let (Some(x), Some(y)) = (num(a), num(b)) {
        return match (x, y) {
            (Num::Int(x), Num::Int(y)) => Some(x.cmp(&y)),
            (x, y) => as_f64(&x).partial_cmp(&as_f64(&y)),
        };
    }
    match (a.kind(), b.kind()) {
        (ValueKind::String, ValueKind::String) => Some(a.as_str().cmp(&b.as_str())),
        (ValueKind::Seq, ValueKind::Seq)
            if !filters::is_generator(a) && !filters::is_generator(b) =>
        {
            let (xs, ys): (Vec<Value>, Vec<Value>) =
                (a.try_iter().ok()?.collect(), b.try_iter().ok()?.collect());
            for (x, y) in xs.iter().zip(&ys) {
                if !py_eq(x, y) {
                    return py_cmp(x, y);
                }
            }
            Some(xs.len().cmp(&ys.len()))
        }
        _ => None,
    }
}

/// Whether Python can order `a` against `b` (what `sorted` needs of its items).
pub(super) fn orderable(a: &Value, b: &Value) -> bool {
    py_cmp(a, b).is_some()
}

/// `a OP b` for an ordering operator: undefined raises, an unorderable pair raises
/// `TypeError`; a NaN compares false.
fn compare(a: &Value, b: &Value, holds: fn(Ordering) -> bool) -> Result<Value, Error> {
    if a.is_undefined() || b.is_undefined() {
        return Err(undefined_error());
    }
    match py_cmp(a, b) {
        Some(o) => Ok(Value::from(holds(o))),
        None if num(a).is_some() && num(b).is_some() => Ok(Value::from(false)),
        None => Err(type_error(format!(
            "'<' not supported between instances of '{}' and '{}'",
            type_name(a),
            type_name(b)
        ))),
    }
}

/// Python's `==` for what a template compares: `1 == 1.0 == True`, containers item by
/// item; an undefined value equals only another undefined value.
fn py_eq(a: &Value, b: &Value) -> bool {
    if let (Some(x), Some(y)) = (num(a), num(b)) {
        return match (x, y) {
            (Num::Int(x), Num::Int(y)) => x == y,
            (x, y) => as_f64(&x) == as_f64(&y),
        };
    }
    a == b
}

/// `needle in haystack` as Python runs it.
fn contains(needle: Value, haystack: Value) -> Result<Value, Error> {
    let found = match haystack.kind() {
        // Jinja2's Undefined iterates as empty.
        ValueKind::Undefined => false,
        ValueKind::String => match needle.as_str() {
            Some(n) if needle.kind() == ValueKind::String => {
                haystack.as_str().unwrap_or_default().contains(n)
            }
            _ => {
                return Err(type_error(format!(
                    "'in <string>' requires string as left operand, not {}",
                    type_name(&needle)
                )))
            }
        },
        ValueKind::Map => {
            if matches!(needle.kind(), ValueKind::Seq | ValueKind::Map) {
                return Err(type_error(format!(
                    "unhashable type: '{}'",
                    type_name(&needle)
                )));
            }
            // A string key is looked up, not searched for: a client's dict can be large,
            // and a template may test it once per item.
            if needle.kind() == ValueKind::String {
                !haystack.get_item(&needle)?.is_undefined()
            } else {
                haystack.try_iter()?.any(|k| py_eq(&k, &needle))
            }
        }
        ValueKind::Seq | ValueKind::Iterable => {
            filters::check_generator(&haystack)?;
            haystack.try_iter()?.any(|x| py_eq(&x, &needle))
        }
        _ => {
            return Err(type_error(format!(
                "argument of type '{}' is not iterable",
                type_name(&haystack)
            )))
        }
    };
    Ok(Value::from(found))
}

/// `a ~ b`: Jinja2 joins `str(a)` and `str(b)`; an undefined side is empty. Sized once:
/// growing the copy of a conversation's text by doubling was a tenth of its render.
fn concat(a: Value, b: Value) -> Value {
    let len = |v: &Value| v.as_str().map_or(0, str::len);
    let mut out = String::with_capacity(len(&a) + len(&b));
    for v in [&a, &b] {
        match (v.kind(), v.as_str()) {
            (ValueKind::String, Some(s)) => out.push_str(s),
            (ValueKind::Undefined, _) => {}
            _ => pyvalue::py_str(v, &mut out),
        }
    }
    Value::from(out)
}

/// The longest string or list `*` may build: a template repeating a client's text
/// must not turn a request into gigabytes.
const MAX_REPEAT: usize = 1 << 20;

/// `a * b`: numbers multiply (booleans are integers), a string or list repeats by an
/// integer (none at all for 0 or less); anything else is Python's `TypeError`.
fn mul(a: Value, b: Value) -> Result<Value, Error> {
    if a.is_undefined() || b.is_undefined() {
        return Err(undefined_error());
    }
    match (num(&a), num(&b)) {
        (Some(Num::Int(x)), Some(Num::Int(y))) => {
            return x
                .checked_mul(y)
                .map(Value::from)
                .ok_or_else(|| type_error("integer too large".into()))
        }
        (Some(x), Some(y)) => return Ok(Value::from(as_f64(&x) * as_f64(&y))),
        _ => {}
    }
    let (seq, n) = match (num(&a), num(&b)) {
        (None, Some(Num::Int(n))) => (&a, n),
        (Some(Num::Int(n)), None) => (&b, n),
        _ => {
            return Err(type_error(format!(
                "unsupported operand type(s) for *: '{}' and '{}'",
                type_name(&a),
                type_name(&b)
            )))
        }
    };
    let times = usize::try_from(n.max(0)).unwrap_or(usize::MAX);
    match seq.kind() {
        ValueKind::String => {
            let s = seq.as_str().unwrap_or_default();
            if s.len().saturating_mul(times) > MAX_REPEAT {
                return Err(type_error("repeated string is too large".into()));
            }
            Ok(Value::from(s.repeat(times)))
        }
        ValueKind::Seq if !filters::is_generator(seq) => {
            let items: Vec<Value> = seq.try_iter()?.collect();
            if items.len().saturating_mul(times) > MAX_REPEAT {
                return Err(type_error("repeated list is too large".into()));
            }
            Ok(Value::from(
                (0..times)
                    .flat_map(|_| items.iter().cloned())
                    .collect::<Vec<_>>(),
            ))
        }
        _ => Err(type_error(format!(
            "can't multiply sequence by non-int of type '{}'",
            type_name(seq)
        ))),
    }
}

/// `-v`: numbers and booleans negate; undefined raises; anything else is a `TypeError`.
fn neg(v: Value) -> Result<Value, Error> {
    match num(&v) {
        Some(Num::Int(i)) => Ok(Value::from(-i)),
        Some(Num::Float(f)) => Ok(Value::from(-f)),
        None if v.is_undefined() => Err(undefined_error()),
        None => Err(type_error(format!(
            "bad operand type for unary -: '{}'",
            type_name(&v)
        ))),
    }
}

#[derive(Clone, Copy)]
enum Arith {
    Sub,
    Div,
    FloorDiv,
    Pow,
}

fn unsupported(op: &str, a: &Value, b: &Value) -> Error {
    type_error(format!(
        "unsupported operand type(s) for {op}: '{}' and '{}'",
        type_name(a),
        type_name(b)
    ))
}

fn zero_division() -> Error {
    Error::new(ErrorKind::InvalidOperation, "division by zero")
}

fn int_result(v: Option<i128>) -> Result<Value, Error> {
    v.map(Value::from)
        .ok_or_else(|| type_error("integer too large".into()))
}

/// Python's `a // b` and `a % b` of floats: floored, the remainder taking `b`'s sign.
fn float_floor_mod(a: f64, b: f64) -> (f64, f64) {
    let m = a % b;
    let m = if m != 0.0 && (m < 0.0) != (b < 0.0) {
        m + b
    } else {
        m
    };
    ((a - m) / b, m)
}

/// `a - b`, `a / b`, `a // b` and `a ** b` of numbers (booleans are integers).
fn arith(a: &Value, b: &Value, op: Arith) -> Result<Value, Error> {
    if a.is_undefined() || b.is_undefined() {
        return Err(undefined_error());
    }
    let name = match op {
        Arith::Sub => "-",
        Arith::Div => "/",
        Arith::FloorDiv => "//",
        Arith::Pow => "** or pow()",
    };
    let (Some(x), Some(y)) = (num(a), num(b)) else {
        return Err(unsupported(name, a, b));
    };
    let zero = as_f64(&y) == 0.0;
    match (op, x, y) {
        (Arith::Sub, Num::Int(x), Num::Int(y)) => int_result(x.checked_sub(y)),
        (Arith::Sub, x, y) => Ok(Value::from(as_f64(&x) - as_f64(&y))),
        (Arith::Div | Arith::FloorDiv, _, _) if zero => Err(zero_division()),
        (Arith::Div, x, y) => Ok(Value::from(as_f64(&x) / as_f64(&y))),
        (Arith::FloorDiv, Num::Int(x), Num::Int(y)) => {
            let q = x
                .checked_div(y)
                .ok_or_else(|| type_error("integer too large".into()))?;
            Ok(Value::from(if (x % y != 0) && ((x < 0) != (y < 0)) {
                q - 1
            } else {
                q
            }))
        }
        (Arith::FloorDiv, x, y) => Ok(Value::from(float_floor_mod(as_f64(&x), as_f64(&y)).0)),
        (Arith::Pow, Num::Int(x), Num::Int(y)) if y >= 0 => {
            int_result(u32::try_from(y).ok().and_then(|e| x.checked_pow(e)))
        }
        (Arith::Pow, x, y) => {
            if as_f64(&x) == 0.0 && as_f64(&y) < 0.0 {
                return Err(zero_division());
            }
            Ok(Value::from(as_f64(&x).powf(as_f64(&y))))
        }
    }
}

/// `a + b`: numbers add, strings and lists concatenate; other pairs are a `TypeError`.
fn add_values(a: Value, b: Value) -> Result<Value, Error> {
    if a.is_undefined() || b.is_undefined() {
        return Err(undefined_error());
    }
    match (num(&a), num(&b)) {
        (Some(Num::Int(x)), Some(Num::Int(y))) => return int_result(x.checked_add(y)),
        (Some(x), Some(y)) => return Ok(Value::from(as_f64(&x) + as_f64(&y))),
        _ => {}
    }
    match (a.kind(), b.kind()) {
        // Python's `Markup` (`'…' | safe`) added to a plain string escapes the plain one.
        (ValueKind::String, ValueKind::String) if a.is_safe() || b.is_safe() => {
            let mut out = String::new();
            for v in [&a, &b] {
                let s = v.as_str().unwrap_or_default();
                if v.is_safe() {
                    out.push_str(s);
                } else {
                    html_escape(s, &mut out);
                }
            }
            Ok(Value::from_safe_string(out))
        }
        // Two plain strings join as `~` joins them, in one copy sized once (a template
        // adds a role tag to a message's whole text).
        (ValueKind::String, ValueKind::String) => Ok(concat(a, b)),
        (ValueKind::Seq, ValueKind::Seq)
            if !filters::is_generator(&a) && !filters::is_generator(&b) =>
        {
            Ok(Value::from(
                a.try_iter()?.chain(b.try_iter()?).collect::<Vec<_>>(),
            ))
        }
        _ => Err(unsupported("+", &a, &b)),
    }
}

/// markupsafe's `escape`: `&`, `<`, `>`, `'` and `"` as entities.
fn html_escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\'' => out.push_str("&#39;"),
            '"' => out.push_str("&#34;"),
            c => out.push(c),
        }
    }
}

/// `a % b`: a string formats (`'%s' % x`; a list spreads as the tuple a literal
/// `(a, b)` is in Jinja2; a dict or undefined value is one argument that a format
/// without conversions leaves unused, as Python's mapping rule does), numbers take
/// Python's floored remainder.
fn modulo(a: Value, b: Value) -> Result<Value, Error> {
    if a.kind() == ValueKind::String {
        let fmt = a.as_str().unwrap_or_default();
        let args: Vec<Value> = match b.kind() {
            ValueKind::Seq if !filters::is_generator(&b) => b.try_iter()?.collect(),
            _ => vec![b.clone()],
        };
        let formatted = pyvalue::percent_format(fmt, &args).or_else(|e| match b.kind() {
            ValueKind::Map | ValueKind::Undefined => pyvalue::percent_format(fmt, &[]),
            _ => Err(e),
        });
        return formatted.map(Value::from).map_err(type_error);
    }
    if a.is_undefined() || b.is_undefined() {
        return Err(undefined_error());
    }
    let (Some(x), Some(y)) = (num(&a), num(&b)) else {
        return Err(unsupported("%", &a, &b));
    };
    if as_f64(&y) == 0.0 {
        return Err(zero_division());
    }
    match (x, y) {
        (Num::Int(x), Num::Int(y)) => {
            let m = x % y;
            Ok(Value::from(if m != 0 && ((m < 0) != (y < 0)) {
                m + y
            } else {
                m
            }))
        }
        (x, y) => Ok(Value::from(float_floor_mod(as_f64(&x), as_f64(&y)).1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_are_pythons() {
        let idx = |len, a, b, s| slice_indices(len, a, b, s);
        assert_eq!(idx(0, None, None, -1), Vec::<usize>::new());
        assert_eq!(idx(3, None, None, -1), vec![2, 1, 0]);
        assert_eq!(idx(5, Some(1), Some(3), 1), vec![1, 2]);
        assert_eq!(idx(5, Some(-2), None, 1), vec![3, 4]);
        assert_eq!(idx(5, Some(10), None, -2), vec![4, 2, 0]);
        assert_eq!(idx(5, None, Some(-10), 1), Vec::<usize>::new());
        // Bounds a client can write, at the edge of the integers.
        assert_eq!(idx(5, Some(1), None, i128::MAX), vec![1]);
        assert_eq!(
            idx(5, Some(i128::MIN), None, i128::MIN),
            Vec::<usize>::new()
        );
        assert_eq!(idx(5, Some(-1), Some(i128::MIN), -3), vec![4, 1]);
        let s = |v: Value| slice(v, Value::from(()), Value::from(()), Value::from(-1));
        assert_eq!(s(Value::from("")).ok(), Some(Value::from("")));
        assert_eq!(s(Value::from("ab")).ok(), Some(Value::from("ba")));
        assert!(s(Value::from(true)).is_err());
        assert!(s(Value::from(())).is_err());
        assert!(s(Value::UNDEFINED).is_err());
        let bad_bound = slice(
            Value::from("ab"),
            Value::from(1.5),
            Value::from(()),
            Value::from(()),
        );
        assert!(bad_bound.is_err());
    }

    #[test]
    fn comparisons_and_membership_raise_where_python_does() {
        let lt = |a: Value, b: Value| compare(&a, &b, Ordering::is_lt);
        assert_eq!(
            lt(Value::from(1), Value::from(1.5)).ok(),
            Some(Value::from(true))
        );
        assert_eq!(
            lt(Value::from(true), Value::from(2)).ok(),
            Some(Value::from(true))
        );
        assert!(lt(Value::from(()), Value::from(0)).is_err());
        assert!(lt(Value::from("a"), Value::from(1)).is_err());
        assert!(lt(Value::UNDEFINED, Value::from(1)).is_err());
        assert!(contains(Value::from(1), Value::from("a1")).is_err());
        assert!(contains(
            Value::from(vec![1]),
            Value::from_serialize(serde_json::json!({"a": 1}))
        )
        .is_err());
        assert_eq!(
            contains(Value::from(1), Value::from(vec![Value::from(true)])).ok(),
            Some(Value::from(true))
        );
        assert_eq!(
            contains(Value::from("x"), Value::UNDEFINED).ok(),
            Some(Value::from(false))
        );
        assert!(contains(Value::from("x"), Value::from(())).is_err());
    }

    #[test]
    fn concat_multiply_negate() {
        assert_eq!(
            concat(Value::from("a"), Value::from(())),
            Value::from("aNone")
        );
        assert_eq!(
            concat(Value::UNDEFINED, Value::from(vec!["x"])),
            Value::from("['x']")
        );
        assert_eq!(
            mul(Value::from("ab"), Value::from(true)).ok(),
            Some(Value::from("ab"))
        );
        assert_eq!(
            mul(Value::from(-1), Value::from("ab")).ok(),
            Some(Value::from(""))
        );
        assert!(mul(Value::from("a"), Value::from(2.5)).is_err());
        assert!(mul(Value::from("a"), Value::from(1 << 30)).is_err());
        assert_eq!(neg(Value::from(true)).ok(), Some(Value::from(-1)));
        assert!(neg(Value::UNDEFINED).is_err());
    }

    #[test]
    fn arithmetic_floors_and_raises_as_python() {
        let f = |a: i64, b: i64| arith(&Value::from(a), &Value::from(b), Arith::FloorDiv);
        assert_eq!(f(-7, 2).ok(), Some(Value::from(-4)));
        assert_eq!(f(7, -2).ok(), Some(Value::from(-4)));
        assert!(f(1, 0).is_err());
        assert!(arith(&Value::from(1), &Value::from(false), Arith::FloorDiv).is_err());
        assert_eq!(
            modulo(Value::from(-7), Value::from(2)).ok(),
            Some(Value::from(1))
        );
        assert_eq!(
            modulo(Value::from(7.5), Value::from(-2)).ok(),
            Some(Value::from(-0.5))
        );
        assert_eq!(
            modulo(Value::from("a"), Value::UNDEFINED).ok(),
            Some(Value::from("a"))
        );
        assert!(modulo(Value::from(5), Value::UNDEFINED).is_err());
        assert_eq!(
            modulo(Value::from("%s-%s"), Value::from(vec![1, 2])).ok(),
            Some(Value::from("1-2"))
        );
        assert!(add_values(Value::from("a"), Value::from(1)).is_err());
        assert_eq!(
            add_values(Value::from(true), Value::from(1)).ok(),
            Some(Value::from(2))
        );
        assert!(arith(&Value::UNDEFINED, &Value::from(1), Arith::Sub).is_err());
        assert_eq!(
            arith(&Value::from(2), &Value::from(-1), Arith::Pow).ok(),
            Some(Value::from(0.5))
        );
    }
}
