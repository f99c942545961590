//! Values as Jinja2 turns them into text: Python's `str()` of each value, which for a
//! list, dict, float, bool or None is its `repr` (`['STRING', 'NULL']`, `{'city': 'Paris'}`,
//! `1e+21`, `True`, `None`). minijinja's own text for containers is JSON-like and its
//! floats never use an exponent, so a template printing a tool call's arguments, a list
//! of parts or a schema's type list would render — and tokenize — differently from the
//! engine. The environment (`template.rs`) prints with these, and the filters that call
//! `str()` (`filters.rs`) use them. Two Python types a template meets without writing
//! them have their own values here: the tuples `dict.items()` and the `items` filter
//! yield ([`Tuple`]), and the views `items()`, `keys()` and `values()` return
//! ([`DictView`]); a tuple literal is made a [`Tuple`] by a source pass (`template.rs`).

use std::fmt::Write;
use std::sync::Arc;

use minijinja::value::{Enumerator, Object, ObjectRepr, Value, ValueKind};
use unicode_categories::UnicodeCategories;

/// A Python tuple: iterates, indexes and unpacks as a list does; prints as `('k', 1)`.
#[derive(Debug)]
pub struct Tuple(pub Vec<Value>);

impl Object for Tuple {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0.get(key.as_usize()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Seq(self.0.len())
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&to_py_str(&Value::from_dyn_object(self.clone())))
    }
}

/// A pair as a [`Tuple`] value.
pub fn pair(k: Value, v: Value) -> Value {
    Value::from_object(Tuple(vec![k, v]))
}

/// What `dict.items()`, `keys()` and `values()` return: iterable with a length, not
/// subscriptable (Jinja2 gives undefined for `d.items()[0]`), not JSON, printed as
/// `dict_items([('k', 1)])`.
#[derive(Debug)]
pub struct DictView {
    pub kind: &'static str,
    pub items: Vec<Value>,
}

impl Object for DictView {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Iterable
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.items.clone())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.items.len())
    }

    fn is_true(self: &Arc<Self>) -> bool {
        !self.items.is_empty()
    }

    fn render(self: &Arc<Self>, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&to_py_str(&Value::from_dyn_object(self.clone())))
    }
}

/// `map.items()`, `keys()` or `values()` (`method`) as Python's view; `None` for another
/// method or a value that is not a dict from the request.
pub fn dict_view(map: &Value, method: &str) -> Option<Value> {
    if map.kind() != ValueKind::Map || !is_plain_map(map) {
        return None;
    }
    let keys = map.try_iter().ok()?;
    let value = |k: &Value| map.get_item(k).unwrap_or_default();
    let (kind, items): (&'static str, Vec<Value>) = match method {
        "items" => (
            "dict_items",
            keys.map(|k| pair(k.clone(), value(&k))).collect(),
        ),
        "keys" => ("dict_keys", keys.collect()),
        "values" => ("dict_values", keys.map(|k| value(&k)).collect()),
        _ => return None,
    };
    Some(Value::from_object(DictView { kind, items }))
}

/// Python's `str(v)`: a string as it is, anything else as [`repr`]; undefined is empty.
pub fn py_str(v: &Value, out: &mut String) {
    match v.kind() {
        ValueKind::String => out.push_str(v.as_str().unwrap_or_default()),
        ValueKind::Undefined => {}
        _ => repr(v, out),
    }
}

/// `py_str` into a new string.
pub fn to_py_str(v: &Value) -> String {
    let mut s = String::new();
    py_str(v, &mut s);
    s
}

/// Python's `repr(v)` for the values a template sees (JSON's types, and what minijinja
/// makes of tuples: lists). Objects minijinja keeps to itself (macros, namespaces, loop
/// state) print as minijinja prints them.
pub fn repr(v: &Value, out: &mut String) {
    if let Some(t) = v.downcast_object_ref::<Tuple>() {
        out.push('(');
        reprs(&t.0, out);
        out.push_str(if t.0.len() == 1 { ",)" } else { ")" });
        return;
    }
    if let Some(d) = v.downcast_object_ref::<DictView>() {
        out.push_str(d.kind);
        out.push_str("([");
        reprs(&d.items, out);
        out.push_str("])");
        return;
    }
    match v.kind() {
        ValueKind::String => str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Number => number(v, out),
        // Python prints a generator with its address; no template means that text.
        ValueKind::Iterable if super::filters::is_generator(v) => {
            out.push_str("<generator object>")
        }
        ValueKind::Seq | ValueKind::Iterable if !v.is_safe() => {
            out.push('[');
            if let Ok(items) = v.try_iter() {
                reprs(&items.collect::<Vec<_>>(), out);
            }
            out.push(']');
        }
        ValueKind::Map if is_plain_map(v) => {
            out.push('{');
            if let Ok(keys) = v.try_iter() {
                for (i, k) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    repr(&k, out);
                    out.push_str(": ");
                    repr(&v.get_item(&k).unwrap_or_default(), out);
                }
            }
            out.push('}');
        }
        // Undefined inside a container cannot come from JSON; Jinja2 would print its
        // class. None and booleans print as Python's already.
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

/// `items`' reprs joined by `, `, as Python writes a container's items.
fn reprs(items: &[Value], out: &mut String) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        repr(item, out);
    }
}

/// A map from the request (a dict to Jinja2), not one of minijinja's own objects.
fn is_plain_map(v: &Value) -> bool {
    v.as_object()
        .is_none_or(|o| matches!(o.repr(), minijinja::value::ObjectRepr::Map))
}

/// An integer as Python prints it; a float as Python's `repr` (shortest round trip,
/// exponent form below 1e-4 and from 1e16 on, `inf`, `nan`).
fn number(v: &Value, out: &mut String) {
    match f64::try_from(v.clone()) {
        Ok(f) if !v.is_integer() => float_repr(f, out),
        _ => {
            let _ = write!(out, "{v}");
        }
    }
}

pub fn float_repr(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("nan");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f < 0.0 { "-inf" } else { "inf" });
        return;
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr does.
    let e = format!("{f:e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((e.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = f.to_string();
        out.push_str(&s);
        if !s.contains('.') {
            out.push_str(".0");
        }
    } else {
        out.push_str(mantissa);
        let _ = write!(
            out,
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        );
    }
}

/// Python's `repr` of a string: single quotes unless the text holds a single quote and
/// no double one; backslash escapes for the quote, `\\`, `\n`, `\r`, `\t` and every
/// character Python does not count as printable (`\xhh`, `\uhhhh`, `\Uhhhhhhhh`).
pub fn str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable` for one character: not a control, format or private-use
/// character, nor a separator other than the ASCII space. (Python also escapes unassigned
/// code points; the category tables here are older than Python's, so a character they do
/// not know — most likely a newer emoji — counts as printable.)
fn printable(c: char) -> bool {
    if c == ' ' {
        return true;
    }
    if c.is_ascii() {
        return !c.is_ascii_control();
    }
    !(c.is_other_control() || c.is_other_format() || c.is_other_private_use() || c.is_separator())
}

/// Python's `fmt % args` for the conversions templates use (`%s`, `%r`, `%d`/`%i`,
/// `%f`/`%F`, `%x`, `%%`, with flags `-` `0` `+` and space, width and precision). Anything
/// else — a mapping key, `*` widths, other conversions, too few or too many arguments —
/// is an error, so the request falls back to prediction rather than rendering wrong text.
pub fn percent_format(fmt: &str, args: &[Value]) -> Result<String, String> {
    let mut out = String::with_capacity(fmt.len());
    let mut next = args.iter();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut flags = String::new();
        while let Some(&f) = chars.peek().filter(|f| "-0+ ".contains(**f)) {
            flags.push(f);
            chars.next();
        }
        let mut width = String::new();
        while let Some(&d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            width.push(d);
            chars.next();
        }
        let mut precision = None;
        if chars.peek() == Some(&'.') {
            chars.next();
            let mut p = String::new();
            while let Some(&d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                p.push(d);
                chars.next();
            }
            precision = Some(p.parse::<usize>().unwrap_or(0));
        }
        let conv = chars.next().ok_or("incomplete format")?;
        if conv == '%' {
            out.push('%');
            continue;
        }
        let arg = next
            .next()
            .ok_or("not enough arguments for format string")?;
        let body = match conv {
            's' => {
                let s = to_py_str(arg);
                match precision {
                    Some(p) => s.chars().take(p).collect(),
                    None => s,
                }
            }
            'r' => {
                let mut s = String::new();
                repr(arg, &mut s);
                s
            }
            'd' | 'i' | 'x' | 'X' => {
                let n = integer(arg).ok_or("%d format: a real number is required")?;
                let digits = match conv {
                    'x' => format!("{:x}", n.unsigned_abs()),
                    'X' => format!("{:X}", n.unsigned_abs()),
                    _ => n.unsigned_abs().to_string(),
                };
                signed(n < 0, &flags, digits)
            }
            'f' | 'F' => {
                let f = real(arg).ok_or("%f format: a real number is required")?;
                let digits = format!("{:.*}", precision.unwrap_or(6), f.abs());
                signed(f.is_sign_negative() && f != 0.0, &flags, digits)
            }
            _ => return Err(format!("unsupported format character '{conv}'")),
        };
        let width: usize = width.parse().unwrap_or(0);
        let len = body.chars().count();
        if len >= width {
            out.push_str(&body);
        } else if flags.contains('-') {
            out.push_str(&body);
            out.extend(std::iter::repeat_n(' ', width - len));
        } else if flags.contains('0') && "dixXfF".contains(conv) {
            let (sign, digits) =
                body.split_at(body.find(|c: char| c.is_ascii_alphanumeric()).unwrap_or(0));
            out.push_str(sign);
            out.extend(std::iter::repeat_n('0', width - len));
            out.push_str(digits);
        } else {
            out.extend(std::iter::repeat_n(' ', width - len));
            out.push_str(&body);
        }
    }
    if next.next().is_some() {
        return Err("not all arguments converted during string formatting".into());
    }
    Ok(out)
}

/// A number's sign as the `+` and space flags ask.
fn signed(negative: bool, flags: &str, digits: String) -> String {
    let sign = if negative {
        "-"
    } else if flags.contains('+') {
        "+"
    } else if flags.contains(' ') {
        " "
    } else {
        ""
    };
    format!("{sign}{digits}")
}

/// Python's `int(v)` of a number: integers, booleans and floats (truncated); `None` for
/// anything else (strings are the `int` filter's to parse).
pub fn integer(v: &Value) -> Option<i128> {
    match v.kind() {
        ValueKind::Bool => Some(i128::from(v.is_true())),
        ValueKind::Number if v.is_integer() => i128::try_from(v.clone()).ok(),
        ValueKind::Number => f64::try_from(v.clone()).ok().and_then(truncate),
        _ => None,
    }
}

/// `int(f)`: toward zero; `None` for infinities and NaN (Python raises).
pub fn truncate(f: f64) -> Option<i128> {
    f.is_finite().then(|| f.trunc() as i128)
}

/// Python's `float(v)` of a number or boolean; `None` for anything else.
pub fn real(v: &Value) -> Option<f64> {
    match v.kind() {
        ValueKind::Bool => Some(if v.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(v.clone()).ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(v: Value) -> String {
        to_py_str(&v)
    }

    #[test]
    fn values_print_as_python_prints_them() {
        let v: Value = serde_json::from_str(
            r#"{"city": "Paris", "n": [1, 2.5, null, true, "it's", "\"q\"", "a\u001cb\n"], "e": {}}"#,
        )
        .expect("json");
        assert_eq!(
            r(v),
            r#"{'city': 'Paris', 'n': [1, 2.5, None, True, "it's", '"q"', 'a\x1cb\n'], 'e': {}}"#
        );
        assert_eq!(r(Value::from("plain 'top'")), "plain 'top'");
        assert_eq!(r(Value::from(())), "None");
        assert_eq!(r(Value::UNDEFINED), "");
        let q: Value = serde_json::from_str(r#"["'\"", "🙂\u2028\u00a0é\u007f"]"#).expect("json");
        assert_eq!(r(q), r#"['\'"', '🙂\u2028\xa0é\x7f']"#);
    }

    #[test]
    fn percent_formats_as_python() {
        let args = [Value::from(3), Value::from(-2.5), Value::from("ab")];
        let f = |s: &str, a: &[Value]| percent_format(s, a);
        // Python: "%s|%5.2f|%-4s|" % (3, -2.5, "ab") == "3|-2.50|ab  |"
        assert_eq!(f("%s|%5.2f|%-4s|", &args).as_deref(), Ok("3|-2.50|ab  |"));
        assert_eq!(f("%03d%% %r", &args[..2]).as_deref(), Ok("003% -2.5"));
        let d: Value = serde_json::from_str(r#"{"a": [1, null]}"#).expect("json");
        assert_eq!(f("%s", &[d]).as_deref(), Ok("{'a': [1, None]}"));
        assert!(f("%s %s", &args[..1]).is_err());
        assert!(f("%s", &args).is_err());
        assert!(f("%q", &args[..1]).is_err());
    }

    #[test]
    fn floats_print_as_python_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.25, "-2.25"),
            (1e21, "1e+21"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (1e-7, "1e-07"),
            (0.0001, "0.0001"),
            (1.5e-5, "1.5e-05"),
            (123456789012345678.0, "1.2345678901234568e+17"),
            (f64::INFINITY, "inf"),
        ] {
            let mut s = String::new();
            float_repr(f, &mut s);
            assert_eq!(s, want, "{f}");
        }
    }
}
