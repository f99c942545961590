//! The chat template, rendered as Hugging Face `transformers` renders it: minijinja
//! configured like transformers' Jinja environment (trim_blocks, lstrip_blocks, loop
//! controls), Python's string and dict methods (minijinja-contrib's pycompat), and the
//! globals and filter transformers adds: `raise_exception`, `strftime_now` and a
//! `tojson` that writes what Python's `json.dumps(x, ensure_ascii=False)` writes
//! (`", "` and `": "` separators, insertion order, `indent`, `sort_keys`), which is not
//! minijinja's compact HTML-safe `tojson`.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::Serialize;

pub const NAME: &str = "chat";

pub fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned(NAME, source)?;
    Ok(env)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format))
        .map_err(|_| Error::new(ErrorKind::InvalidOperation, "bad strftime format"))?;
    Ok(out)
}

fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    // ensure_ascii and separators are accepted as transformers accepts them; only the
    // defaults (False, None) are what templates use.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&v)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys.unwrap_or(false) {
        sort(&mut json);
    }
    let mut buf = Vec::new();
    let fmt = PyFormatter {
        indent,
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    json.serialize(&mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let s = String::from_utf8(buf)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    // Inserted as is (transformers' templates are not autoescaped).
    Ok(Value::from_safe_string(s))
}

fn sort(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.sort_keys();
            m.values_mut().for_each(sort);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort),
        _ => {}
    }
}

/// serde_json output shaped like Python's `json.dumps`: `", "`/`": "` without indent;
/// with indent, newlines and `","`/`": "`.
struct PyFormatter {
    indent: Option<usize>,
    level: usize,
    has_value: bool,
}

impl PyFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(n) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..n * self.level {
                w.write_all(b" ")?;
            }
        }
        Ok(())
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: serde_json::Value) -> String {
        let env = environment(src.to_string()).expect("template");
        env.get_template(NAME)
            .expect("t")
            .render(ctx)
            .expect("render")
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let ctx = serde_json::json!({"x": {"b": [1, "é<>&'", null, true], "a": {"z": 1.5}}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"b": [1, "é<>&'", null, true], "a": {"z": 1.5}}"#
        );
        assert_eq!(
            render("{{ x | tojson(sort_keys=true) }}", ctx.clone()),
            r#"{"a": {"z": 1.5}, "b": [1, "é<>&'", null, true]}"#
        );
        assert_eq!(
            render("{{ x.a | tojson(indent=2) }}", ctx),
            "{\n  \"z\": 1.5\n}"
        );
    }

    #[test]
    fn python_methods_and_loop_controls_work() {
        let out = render(
            "{% for m in ms %}{% if m.startswith('#') %}{% continue %}{% endif %}[{{ m.strip() }}]{% endfor %}{% set ns = namespace(n=0) %}{% for m in ms %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
            serde_json::json!({"ms": [" a ", "#skip", "b\n"]}),
        );
        assert_eq!(out, "[a][b]3");
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let env = environment("{{ raise_exception('no system role') }}".into()).expect("t");
        let e = env
            .get_template(NAME)
            .expect("t")
            .render(serde_json::json!({}))
            .expect_err("raises");
        assert!(e.to_string().contains("no system role"), "{e}");
    }
}
