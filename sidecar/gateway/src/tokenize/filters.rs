//! Jinja2's filters and tests where minijinja's differ from what a chat template gets
//! under transformers: every filter that calls Python's `str()` on its input (`string`,
//! `join`, `upper`, `lower`, `capitalize`, `replace`, `format`'s `%`), and Jinja2's
//! treatment of undefined and None (`length` of undefined is 0, `first`/`last` of nothing
//! is undefined, `float`/`int` fall back to their defaults, `iterable` is Python's
//! `iter()`), and the filters Jinja2 writes as generators (`select`, `selectattr`,
//! `reject`, `rejectattr`, `map`, `items`): their result is lazy, so it is true in an
//! `if` even when it would yield nothing, has no length and no last item, and an input
//! they cannot go through fails only where the result is iterated, not where it is made.
//! Python's `iter()` refuses None where minijinja iterates it as empty, so every filter
//! that iterates its input in Jinja2 (and every `for` loop, `template.rs`) refuses it
//! first ([`not_none`]); `sequence` is Python's "has a length and items".
//! Each is proven against Jinja2 by `tests/tests/template_fidelity.rs`.

use std::borrow::Cow;
use std::sync::Arc;

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Rest, Value};
use minijinja::{Environment, Error, ErrorKind, State};

use super::pyvalue;
use super::template::{py_strip, Ends};

/// Installs these over minijinja's built-ins of the same names.
pub fn add(env: &mut Environment<'static>) {
    env.add_filter("string", string);
    env.add_filter("join", join);
    env.add_filter("length", length);
    env.add_filter("count", length);
    env.add_filter("upper", |v: Value| {
        Value::from(pyvalue::to_py_str(&v).to_uppercase())
    });
    env.add_filter("lower", |v: Value| {
        Value::from(pyvalue::to_py_str(&v).to_lowercase())
    });
    env.add_filter("capitalize", capitalize);
    env.add_filter("replace", replace);
    env.add_filter("first", |v: Value| end_item(v, true));
    env.add_filter("last", |v: Value| end_item(v, false));
    env.add_filter("float", to_float);
    env.add_filter("int", to_int);
    env.add_filter("format", |fmt: Value, args: Rest<Value>| {
        pyvalue::percent_format(&pyvalue::to_py_str(&fmt), &args)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
    });
    env.add_test("iterable", iterable);
    // Python's `bool` is a `Number`: `true is number` holds in Jinja2.
    env.add_test("number", |v: Value| {
        matches!(
            v.kind(),
            minijinja::value::ValueKind::Number | minijinja::value::ValueKind::Bool
        )
    });
    env.add_test("sequence", sequence);
    env.add_filter("reverse", |v: Value| {
        not_none(&v)?;
        minijinja::filters::reverse(&v)
    });
    env.add_filter("sum", |state: &State, v: Value| {
        not_none(&v)?;
        minijinja::filters::sum(state, v)
    });
    env.add_filter("min", |state: &State, v: Value| {
        not_none(&v)?;
        minijinja::filters::min(state, v)
    });
    env.add_filter("max", |state: &State, v: Value| {
        not_none(&v)?;
        minijinja::filters::max(state, v)
    });
    env.add_filter("sort", |state: &State, v: Value, kwargs: Kwargs| {
        not_none(&v)?;
        // Python's `sorted` raises on items it cannot order (`[1, 'a']`).
        if kwargs.peek::<Option<Value>>("attribute")?.is_none() {
            let mut items = v.try_iter()?;
            if let Some(first) = items.next() {
                if items.any(|x| !super::pyops::orderable(&first, &x)) {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "'<' not supported between these items",
                    ));
                }
            }
        }
        minijinja::filters::sort(state, v, kwargs)
    });
    // A generator in Jinja2, as `select` is: nothing fails until it is iterated.
    env.add_filter("unique", |state: &State, v: Value, kwargs: Kwargs| {
        Generator::made(&v, || {
            not_none(&v)?;
            minijinja::filters::unique(state, v.clone(), kwargs)?
                .try_iter()
                .map(Iterator::collect)
        })
    });
    env.add_filter(
        "batch",
        |state: &State, v: Value, count: usize, fill: Option<Value>| {
            not_none(&v)?;
            minijinja::filters::batch(state, v, count, fill)
        },
    );
    env.add_filter("list", list);
    // Its items are tuples, as `dict.items()`'s are.
    env.add_filter("items", |v: Value| {
        Generator::made(&v, || match v.kind() {
            minijinja::value::ValueKind::Undefined => Ok(Vec::new()),
            _ => minijinja::filters::items(&v)?
                .try_iter()
                .map(|pairs| pairs.map(as_tuple).collect()),
        })
    });
    env.add_filter("select", by_test(minijinja::filters::select));
    env.add_filter("reject", by_test(minijinja::filters::reject));
    env.add_filter("selectattr", by_attr(minijinja::filters::selectattr));
    env.add_filter("rejectattr", by_attr(minijinja::filters::rejectattr));
    env.add_filter("map", |state: &State, v: Value, args: Rest<Value>| {
        Generator::made(&v, || minijinja::filters::map(state, v.clone(), args))
    });
}

/// minijinja's `select`/`reject` made a generator filter.
type ByTest = fn(&State, Value, Option<Cow<'_, str>>, Rest<Value>) -> Result<Vec<Value>, Error>;
fn by_test(f: ByTest) -> impl Fn(&State, Value, Option<String>, Rest<Value>) -> Value {
    move |state, v, test, args| {
        Generator::made(&v, || f(state, v.clone(), test.map(Cow::Owned), args))
    }
}

/// minijinja's `selectattr`/`rejectattr` made a generator filter.
type ByAttr =
    fn(&State, Value, Cow<'_, str>, Option<Cow<'_, str>>, Rest<Value>) -> Result<Vec<Value>, Error>;
fn by_attr(f: ByAttr) -> impl Fn(&State, Value, String, Option<String>, Rest<Value>) -> Value {
    move |state, v, attr, test, args| {
        Generator::made(&v, || {
            f(
                state,
                v.clone(),
                Cow::Owned(attr),
                test.map(Cow::Owned),
                args,
            )
        })
    }
}

/// What a Jinja2 generator filter returned: its items, computed at once (templates are
/// small and a context's values cannot change under it), or the error iterating it
/// raises. Unlike a list it is always true, has no length and cannot be reversed. (A
/// Python generator also runs dry after one pass; a template that iterates one result
/// twice sees it twice here.)
#[derive(Debug)]
struct Generator(Result<Vec<Value>, String>);

impl Generator {
    /// `make`'s items as a generator; a failed generator stays failed through another.
    fn made(input: &Value, make: impl FnOnce() -> Result<Vec<Value>, Error>) -> Value {
        if let Some(Err(e)) = Generator::of(input) {
            return Value::from_object(Generator(Err(e.clone())));
        }
        Value::from_object(Generator(make().map_err(|e| e.to_string())))
    }

    /// `v`'s items, or the error iterating it raises, when `v` is a generator.
    fn of(v: &Value) -> Option<&Result<Vec<Value>, String>> {
        v.downcast_object_ref::<Generator>().map(|g| &g.0)
    }

    /// The error iterating `v` raises, when it is a failed generator.
    fn check(v: &Value) -> Result<(), Error> {
        match Generator::of(v) {
            Some(Err(e)) => Err(Error::new(ErrorKind::InvalidOperation, e.clone())),
            _ => Ok(()),
        }
    }
}

impl Object for Generator {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        match &self.0 {
            Ok(items) => Enumerator::Values(items.clone()),
            // A `for` over it fails on this item, as Python's iteration raises.
            Err(e) => Enumerator::Values(vec![Value::from(Error::new(
                ErrorKind::InvalidOperation,
                e.clone(),
            ))]),
        }
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        None
    }

    fn is_true(self: &Arc<Self>) -> bool {
        true
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<generator object>")
    }
}

/// Jinja2's `list`: Python's `list()`, which runs a generator (and raises its error).
fn list(state: &State, v: Value) -> Result<Value, Error> {
    not_none(&v)?;
    Generator::check(&v)?;
    match Generator::of(&v) {
        Some(Ok(items)) => Ok(Value::from(items.clone())),
        _ => minijinja::filters::list(state, v),
    }
}

/// A pair minijinja made (a two-item list) as Python's tuple.
fn as_tuple(v: Value) -> Value {
    match v.try_iter() {
        Ok(items) => Value::from_object(pyvalue::Tuple(items.collect())),
        Err(_) => v,
    }
}

/// The error iterating `v` raises, when it is a generator filter's failed result.
pub(super) fn check_generator(v: &Value) -> Result<(), Error> {
    Generator::check(v)
}

/// Whether `v` is what a Jinja2 generator filter returned.
pub(super) fn is_generator(v: &Value) -> bool {
    Generator::of(v).is_some()
}

/// Jinja2's `string` filter: Python's `str()`.
fn string(v: Value) -> Value {
    if v.kind() == minijinja::value::ValueKind::String {
        v
    } else {
        Value::from(pyvalue::to_py_str(&v))
    }
}

/// Jinja2's `join`: each item (or its `attribute`) as Python's `str()`, `d` between.
fn join(v: Value, d: Option<String>, kwargs: Kwargs) -> Result<String, Error> {
    let attribute: Option<Value> = kwargs.get("attribute")?;
    let d: Option<String> = match d {
        Some(d) => Some(d),
        None => kwargs.get("d")?,
    };
    kwargs.assert_all_used()?;
    if v.is_undefined() {
        return Ok(String::new());
    }
    not_none(&v)?;
    Generator::check(&v)?;
    let items = v.try_iter()?;
    let mut out = String::new();
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push_str(d.as_deref().unwrap_or_default());
        }
        let item = match &attribute {
            Some(a) => match a.as_str() {
                Some(path) => {
                    path.split('.')
                        .try_fold(item, |v, part| match part.parse::<i64>() {
                            Ok(n) if v.kind() == minijinja::value::ValueKind::Seq => {
                                v.get_item(&Value::from(n))
                            }
                            _ => v.get_attr(part),
                        })?
                }
                None => item.get_item(a)?,
            },
            None => item,
        };
        pyvalue::py_str(&item, &mut out);
    }
    Ok(out)
}

/// Python's `str.capitalize` of `str(v)`: the first character upper case, the rest lower.
fn capitalize(v: Value) -> Value {
    let s = pyvalue::to_py_str(&v);
    let mut chars = s.chars();
    Value::from(match chars.next() {
        None => String::new(),
        Some(c) => c
            .to_uppercase()
            .chain(chars.flat_map(char::to_lowercase))
            .collect(),
    })
}

/// Jinja2's `replace`: `str(v).replace(old, new[, count])`.
fn replace(v: Value, old: Value, new: Value, count: Option<i64>) -> Value {
    let (s, old, new) = (
        pyvalue::to_py_str(&v),
        pyvalue::to_py_str(&old),
        pyvalue::to_py_str(&new),
    );
    Value::from(match count.filter(|n| *n >= 0) {
        Some(n) => s.replacen(&old, &new, usize::try_from(n).unwrap_or(usize::MAX)),
        None => s.replace(&old, &new),
    })
}

/// Jinja2's `first`/`last`: an undefined value, or an empty string, list or dict, gives
/// undefined (Jinja2's "no first item"), which prints as nothing; None and numbers raise.
fn end_item(v: Value, first: bool) -> Result<Value, Error> {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::Undefined => Ok(Value::UNDEFINED),
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            let c = if first {
                s.chars().next()
            } else {
                s.chars().next_back()
            };
            Ok(c.map_or(Value::UNDEFINED, Value::from))
        }
        // Python cannot reverse a generator.
        ValueKind::Iterable if !first && is_generator(&v) => Err(Error::new(
            ErrorKind::InvalidOperation,
            "'generator' object is not reversible",
        )),
        ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
            Generator::check(&v)?;
            let mut items = v.try_iter()?;
            Ok(if first { items.next() } else { items.last() }.unwrap_or(Value::UNDEFINED))
        }
        k => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("'{k}' object is not iterable"),
        )),
    }
}

/// Jinja2's `float(default=0.0)`: Python's `float()` of the value, the default when that
/// fails (a string that is no number, a list, None); an undefined value raises, as
/// `float(Undefined)` does.
fn to_float(v: Value, default: Option<Value>) -> Result<Value, Error> {
    if v.is_undefined() {
        return Err(super::pyops::undefined_error());
    }
    let parsed = match v.as_str() {
        Some(s) => py_float(s),
        None => pyvalue::real(&v),
    };
    Ok(parsed.map_or_else(|| default.unwrap_or(Value::from(0.0)), Value::from))
}

/// Jinja2's `int(default=0, base=10)`: `int()` of the value, else of its `float()`, else
/// the default; an undefined value raises. (Only base 10; another base is refused.)
fn to_int(v: Value, default: Option<Value>, base: Option<i64>) -> Result<Value, Error> {
    if v.is_undefined() {
        return Err(super::pyops::undefined_error());
    }
    if base.is_some_and(|b| b != 10) {
        return Err(Error::new(ErrorKind::InvalidOperation, "int: only base 10"));
    }
    let parsed = match v.as_str() {
        Some(s) => {
            let t = py_strip(s, None, Ends::Both);
            let digits = !t.starts_with('_') && !t.ends_with('_') && !t.contains("__");
            t.replace('_', "")
                .parse::<i128>()
                .ok()
                .filter(|_| digits)
                .or_else(|| py_float(s).and_then(pyvalue::truncate))
        }
        None => pyvalue::integer(&v),
    };
    Ok(parsed.map_or_else(|| default.unwrap_or(Value::from(0)), Value::from))
}

/// Python's `float(str)` for the forms a template meets: surrounding whitespace,
/// a sign, digits with an exponent, `inf`/`infinity`/`nan` in any case.
fn py_float(s: &str) -> Option<f64> {
    let t = py_strip(s, None, Ends::Both);
    let body = t.trim_start_matches(['+', '-']);
    if t.len() - body.len() > 1 {
        return None;
    }
    let lower = body.to_ascii_lowercase();
    if matches!(lower.as_str(), "inf" | "infinity" | "nan") {
        return t.to_ascii_lowercase().parse::<f64>().ok();
    }
    let ok = !body.is_empty()
        && body
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
    if ok {
        t.parse::<f64>().ok()
    } else {
        None
    }
}

/// Jinja2's `iterable` test (`iter(v)` succeeds): strings, lists, dicts and undefined
/// values (Jinja2's `Undefined` iterates as empty); not None, numbers or booleans, which
/// minijinja would iterate as empty.
/// Python's `iter(None)`: a `TypeError`, where minijinja iterates `none` as empty.
pub(super) fn not_none(v: &Value) -> Result<(), Error> {
    if v.is_none() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "'NoneType' object is not iterable",
        ));
    }
    Ok(())
}

/// Jinja2's `sequence` test: `len(value)` and `value.__getitem__` both exist, so strings,
/// lists, maps and an undefined value are sequences; None, numbers, booleans and the
/// generator filters' results are not.
fn sequence(v: Value) -> bool {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map => {
            !is_generator(&v)
        }
        _ => false,
    }
}

fn iterable(v: Value) -> bool {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map => true,
        _ => v.try_iter().is_ok(),
    }
}

/// Jinja2's `length`/`count`: Python's `len()`, which is 0 for an undefined value (Jinja2's
/// `Undefined` has a length) and an error for None, numbers and booleans.
fn length(v: Value) -> Result<Value, Error> {
    if v.is_undefined() {
        return Ok(Value::from(0));
    }
    v.len().map(Value::from).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("object of type {} has no len()", v.kind()),
        )
    })
}
