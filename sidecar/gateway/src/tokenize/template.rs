//! The chat template, rendered as Hugging Face `transformers` renders it: minijinja
//! configured like transformers' Jinja environment (trim_blocks, lstrip_blocks, loop
//! controls), Python's string and dict methods (minijinja-contrib's pycompat), and the
//! globals and filter transformers adds: `raise_exception`, `strftime_now` and a
//! `tojson` that writes what Python's `json.dumps(x, ensure_ascii=False)` writes
//! (`", "` and `": "` separators, insertion order, `indent`, `sort_keys`), which is not
//! minijinja's compact HTML-safe `tojson`. Values print as Python's `str()` prints them
//! (`pyvalue.rs`), the filters that differ are Jinja2's (`filters.rs`), the source is
//! read as Jinja2's lexer reads it (newlines, transformers' `generation` tag), with every
//! `for` loop's iterable passed through a check that fails on `none` as Python's `iter()`
//! does (minijinja iterates `none` as empty, hard-wired in its `Value::try_iter`), tuple
//! literals made Python's tuples and literal operands kept from compile-time folding
//! (three passes over minijinja's own lexer), and the compiled program's operators are
//! Python's (`pyops.rs`): the template is compiled here with minijinja's compiler,
//! rewritten, and run on minijinja's VM ([`ChatTemplate`]).
//!
//! Whitespace is Python's: `str.strip`/`lstrip`/`rstrip`/`split()`/`isspace` and Jinja's
//! `trim` filter count U+001C–U+001F as whitespace (Python's `str.isspace`), which Rust's
//! `char::is_whitespace` — and so minijinja's own versions — do not; `str.splitlines`
//! breaks at more than `\n`. A message ending in one would otherwise render, and tokenize,
//! differently from the engine. These versions also hand back the same string (no copy)
//! when there is nothing to strip, the common case for `message['content'] | trim`.

use std::sync::Arc;

use minijinja::machinery::{make_string_output, CompiledTemplate, TemplateConfig, Vm};
use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::Serialize;

use super::{filters, pyops, pyvalue};

pub const NAME: &str = "chat";

self_cell::self_cell!(
    /// A template's source and the program minijinja compiled from it (which borrows it).
    struct Program {
        owner: String,
        #[not_covariant]
        dependent: CompiledTemplate,
    }
);

/// A chat template ready to render: the environment (filters, functions, formatter) and
/// the template compiled by minijinja's own compiler with its operators made Python's
/// ([`pyops::rewrite`]), run on minijinja's own VM.
pub struct ChatTemplate {
    env: Environment<'static>,
    program: Program,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

pub fn environment(source: String) -> Result<ChatTemplate, Error> {
    environment_at(source, None)
}

/// [`environment`] whose `strftime_now` reads `clock` when given, else the time.
fn environment_at(
    source: String,
    clock: Option<chrono::DateTime<chrono::Local>>,
) -> Result<ChatTemplate, Error> {
    let mut env = Environment::new();
    // Printing is Python's `str()`: reprs for containers, floats and strings inside them.
    env.set_formatter(|out, _state, v| {
        match v.as_str() {
            Some(s) => out.write_str(s),
            None => out.write_str(&pyvalue::to_py_str(v)),
        }
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "write failed"))
    });
    env.set_unknown_method_callback(python_methods);
    env.add_filter("tojson", tojson);
    env.add_filter("trim", trim);
    env.add_filter("indent", indent);
    filters::add(&mut env);
    env.add_function("raise_exception", raise_exception);
    env.add_function(ITERABLE, iterable);
    env.add_function(LITERAL, |v: Value| v);
    env.add_function(TUPLE, |items: minijinja::value::Rest<Value>| {
        Value::from_object(pyvalue::Tuple(items.0))
    });
    env.add_function("strftime_now", move |format: String| {
        strftime(clock.unwrap_or_else(chrono::Local::now), &format)
    });
    pyops::add(&mut env);
    let program = Program::try_new(jinja_source(source), |src| {
        // What transformers' environment sets: trim_blocks, lstrip_blocks, the trailing
        // newline dropped, no autoescaping. (The environment compiles no template itself.)
        let config = TemplateConfig {
            syntax_config: Default::default(),
            ws_config: minijinja::machinery::WhitespaceConfig {
                keep_trailing_newline: false,
                lstrip_blocks: true,
                trim_blocks: true,
            },
            default_auto_escape: Arc::new(|_: &str| AutoEscape::None),
        };
        let mut compiled = CompiledTemplate::new(NAME, src, &config)?;
        let slot = compiled
            .blocks
            .values()
            .map(pyops::free_slot)
            .fold(pyops::free_slot(&compiled.instructions), u8::max);
        pyops::rewrite(&mut compiled.instructions, slot);
        for block in compiled.blocks.values_mut() {
            pyops::rewrite(block, slot);
        }
        Ok::<_, Error>(compiled)
    })?;
    Ok(ChatTemplate { env, program })
}

/// The template source as Jinja2's lexer reads it: every newline (`\r\n`, `\r`) is `\n`
/// (a template saved with Windows line endings renders Unix ones), and transformers'
/// `{% generation %}` … `{% endgeneration %}` block (it only marks the assistant's text
/// for training masks) becomes an `if true` block with the same whitespace control.
fn jinja_source(source: String) -> String {
    let mut s = if source.contains('\r') {
        source.replace("\r\n", "\n").replace('\r', "\n")
    } else {
        source
    };
    if s.contains("generation") {
        s = generation_blocks(&s);
    }
    if s.contains(',') || s.contains("()") {
        s = tuple_literals(s);
    }
    s = unfolded_literals(s);
    if s.contains("for") {
        s = checked_loops(s);
    }
    s
}

/// The function [`unfolded_literals`] wraps a literal in: the identity, by a name no
/// template uses.
const LITERAL: &str = "__kvroute_literal";

/// `7 // -2` → `(__kvroute_literal(7)) // -2`: minijinja's compiler folds an operator whose
/// operands are all literals into its result, with its own semantics (`-3` there, where
/// Python floors to `-4`; `1 < 'a'` answered where Python raises), before `pyops` can
/// rewrite it. A literal left of an operator that `pyops` rewrites, with a literal (or a
/// signed one) right of it, is wrapped so the operator runs at render time. Parenthesized
/// or container operands are not seen and keep minijinja's folding. A source the lexer
/// refuses is returned unchanged.
fn unfolded_literals(s: String) -> String {
    match folded_operands(&s) {
        // In parentheses of its own: minijinja binds a unary minus tighter than a call.
        Some(spans) if !spans.is_empty() => wrap_spans(&s, &spans, &format!("({LITERAL}("), "))"),
        _ => s,
    }
}

/// `s` with each of `spans` (byte ranges, in order, not overlapping; an empty one is an
/// insertion point) put between `before` and `after`: how the source pre-passes edit.
fn wrap_spans(s: &str, spans: &[(usize, usize)], before: &str, after: &str) -> String {
    let mut out = String::with_capacity(s.len() + spans.len() * (before.len() + after.len()));
    let mut last = 0;
    for &(from, to) in spans {
        out.push_str(&s[last..from]);
        out.push_str(before);
        out.push_str(&s[from..to]);
        out.push_str(after);
        last = to;
    }
    out.push_str(&s[last..]);
    out
}

/// The byte ranges of the literals [`unfolded_literals`] wraps, in order; `None` when the
/// lexer refuses the source.
fn folded_operands(s: &str) -> Option<Vec<(usize, usize)>> {
    use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
    use minijinja::syntax::SyntaxConfig;

    fn literal(t: &Token) -> bool {
        matches!(
            t,
            Token::Str(_) | Token::String(_) | Token::Int(_) | Token::Int128(_) | Token::Float(_)
        ) || matches!(
            t,
            Token::Ident("true" | "false" | "none" | "True" | "False" | "None")
        )
    }
    fn operator(t: &Token) -> bool {
        matches!(
            t,
            Token::Plus
                | Token::Minus
                | Token::Mul
                | Token::Div
                | Token::FloorDiv
                | Token::Pow
                | Token::Mod
                | Token::Tilde
                | Token::Lt
                | Token::Lte
                | Token::Gt
                | Token::Gte
                | Token::Ident("in")
        )
    }
    #[allow(clippy::default_constructed_unit_structs)]
    let syntax = SyntaxConfig::default();
    let mut toks = Vec::new();
    for tok in tokenize(s, false, syntax, WhitespaceConfig::default()) {
        let (tok, span) = tok.ok()?;
        toks.push((tok, span.start_offset as usize, span.end_offset as usize));
    }
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for i in 1..toks.len() {
        let (op, left) = (&toks[i].0, &toks[i - 1]);
        if !operator(op) || !literal(&left.0) {
            continue;
        }
        let right = match toks.get(i + 1) {
            Some((Token::Plus | Token::Minus, _, _)) => toks.get(i + 2),
            r => r,
        };
        if right.is_some_and(|r| literal(&r.0)) && spans.last().is_none_or(|l| l.1 <= left.1) {
            spans.push((left.1, left.2));
        }
    }
    Some(spans)
}

/// The function [`tuple_literals`] marks a tuple literal with: a name no template uses.
const TUPLE: &str = "__kvroute_tuple";

/// Words after which a `(` opens an expression, not a call's arguments.
const EXPRESSION_WORDS: [&str; 8] = ["in", "not", "and", "or", "if", "else", "elif", "do"];

/// `(a, b)`, `(a,)` and `()` in an expression → `__kvroute_tuple(a, b)`, …: minijinja
/// parses a tuple literal as a list, and Python prints a tuple as `('t', 1)`. Found with
/// minijinja's lexer: a `(` is a tuple's when it does not follow a name, `)` or `]` (then
/// it is a call's, a macro's or a filter's arguments) or an assignment's target (`for
/// (a, b) in`, `set`, `with`), and holds a comma at its own depth or nothing. A source the
/// lexer refuses is returned unchanged.
fn tuple_literals(s: String) -> String {
    match tuple_marks(&s) {
        Some(mut marks) if !marks.is_empty() => {
            marks.sort_unstable();
            let spans: Vec<(usize, usize)> = marks.into_iter().map(|at| (at, at)).collect();
            wrap_spans(&s, &spans, TUPLE, "")
        }
        _ => s,
    }
}

/// The byte offsets of the `(` that open tuple literals; `None` when the lexer refuses
/// the source.
fn tuple_marks(s: &str) -> Option<Vec<usize>> {
    use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
    use minijinja::syntax::SyntaxConfig;

    struct Open {
        at: usize,
        paren: bool,
        tuple_candidate: bool,
        comma: bool,
        empty: bool,
    }
    #[allow(clippy::default_constructed_unit_structs)]
    let syntax = SyntaxConfig::default();
    let mut marks = Vec::new();
    let mut stack: Vec<Open> = Vec::new();
    // Inside a tag's assignment target (after `for`, `set` or `with`, before `in`/`=`).
    let (mut tag_word, mut in_target) = (true, false);
    let mut prev: Option<Token> = None;
    for tok in tokenize(s, false, syntax, WhitespaceConfig::default()) {
        let (tok, span) = tok.ok()?;
        let at = span.start_offset as usize;
        let closes = matches!(
            tok,
            Token::ParenClose | Token::BracketClose | Token::BraceClose
        );
        if let Some(top) = stack.last_mut().filter(|_| !closes) {
            top.empty = false;
        }
        match &tok {
            Token::BlockStart | Token::VariableStart => {
                stack.clear();
                tag_word = matches!(tok, Token::BlockStart);
                in_target = false;
            }
            Token::Ident(w) if tag_word => {
                in_target = matches!(*w, "for" | "set" | "with");
                tag_word = false;
            }
            Token::Ident("in") | Token::Assign if stack.is_empty() => in_target = false,
            Token::ParenOpen | Token::BracketOpen | Token::BraceOpen => {
                let call = match &prev {
                    Some(Token::Ident(w)) => !EXPRESSION_WORDS.contains(w),
                    Some(Token::ParenClose | Token::BracketClose | Token::Str(_)) => true,
                    _ => false,
                };
                stack.push(Open {
                    at,
                    paren: matches!(tok, Token::ParenOpen),
                    tuple_candidate: !call && !in_target,
                    comma: false,
                    empty: true,
                });
            }
            Token::Comma => {
                if let Some(top) = stack.last_mut() {
                    top.comma = true;
                }
            }
            Token::ParenClose | Token::BracketClose | Token::BraceClose => {
                if let Some(open) = stack.pop() {
                    if open.paren && open.tuple_candidate && (open.comma || open.empty) {
                        marks.push(open.at);
                    }
                }
            }
            _ => {}
        }
        if !matches!(tok, Token::BlockStart | Token::VariableStart) {
            tag_word = false;
        }
        prev = Some(tok);
    }
    Some(marks)
}

/// The function [`checked_loops`] wraps every loop's iterable in: a name no template uses.
const ITERABLE: &str = "__kvroute_iterable";

/// A `for` loop's iterable as Jinja2 takes it: `none` raises (Python's `TypeError:
/// 'NoneType' object is not iterable`); a string becomes the list of its characters, so
/// `loop.length` and `loop.revindex` know its length as Python's `len()` does (minijinja's
/// loop over a string does not); undefined, lists, maps and the lazy filters' generators
/// go on to minijinja's loop, which iterates them as Jinja2 does.
fn iterable(v: Value) -> Result<Value, Error> {
    filters::not_none(&v)?;
    Ok(match v.as_str() {
        Some(s) => Value::from(s.chars().map(Value::from).collect::<Vec<_>>()),
        None => v,
    })
}

/// `{% for T in ITER [if C] [recursive] %}` → `{% for T in __kvroute_iterable((ITER)) … %}`.
/// The iterable is found with minijinja's own lexer (strings, comments and raw blocks
/// are its business, not a text search's): it runs from the token after the first `in`
/// at bracket depth 0 to the last token before a depth-0 `if` or `recursive` or the end
/// of the tag, which is where minijinja's parser ends it too (`parse_expr_noif`). It is
/// wrapped in a second pair of parentheses, which makes a bare tuple (`for x in a, b`,
/// Jinja2's but not minijinja's syntax) the one argument it is in Jinja2. A source the
/// lexer refuses is returned unchanged for the compiler to refuse with its own message.
fn checked_loops(s: String) -> String {
    match loop_iterables(&s) {
        Some(spans) if !spans.is_empty() => wrap_spans(&s, &spans, &format!("{ITERABLE}(("), "))"),
        _ => s,
    }
}

/// The byte ranges of the iterables [`checked_loops`] wraps, in order; `None` when the
/// lexer refuses the source.
fn loop_iterables(s: &str) -> Option<Vec<(usize, usize)>> {
    use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
    use minijinja::syntax::SyntaxConfig;

    #[derive(PartialEq)]
    enum At {
        Outside,
        TagStart,
        Target,
        Iter,
        Rest,
    }
    let mut spans = Vec::new();
    let (mut at, mut depth) = (At::Outside, 0usize);
    let (mut start, mut end) = (0usize, 0usize);
    // A unit struct here, but not where a crate turns on minijinja's `custom_syntax`.
    #[allow(clippy::default_constructed_unit_structs)]
    let syntax = SyntaxConfig::default();
    for tok in tokenize(s, false, syntax, WhitespaceConfig::default()) {
        let (tok, span) = tok.ok()?;
        let (from, to) = (span.start_offset as usize, span.end_offset as usize);
        match tok {
            Token::ParenOpen | Token::BracketOpen | Token::BraceOpen => depth += 1,
            Token::ParenClose | Token::BracketClose | Token::BraceClose => {
                depth = depth.saturating_sub(1)
            }
            _ => {}
        }
        let top = depth == 0;
        at = match (at, &tok) {
            (_, Token::BlockStart) => At::TagStart,
            (At::TagStart, Token::Ident("for")) => At::Target,
            (At::Target, Token::Ident("in")) if top => {
                start = usize::MAX;
                At::Iter
            }
            (At::Target, _) => At::Target,
            (At::Iter, Token::Ident("if" | "recursive") | Token::BlockEnd) if top => {
                if start < end {
                    spans.push((start, end));
                }
                At::Rest
            }
            (At::Iter, _) => {
                if start == usize::MAX {
                    start = from;
                }
                end = to;
                At::Iter
            }
            (_, Token::BlockEnd) => At::Outside,
            (At::Rest, _) => At::Rest,
            _ => At::Outside,
        };
    }
    Some(spans)
}

/// `{%-? generation -?%}` → `{%-? if true -?%}`, `endgeneration` → `endif`.
fn generation_blocks(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at + 2]);
        rest = &rest[at + 2..];
        let lead = rest.len() - rest.trim_start_matches(['-', '+']).len();
        let body = &rest[lead..];
        let ws = body.len() - body.trim_start().len();
        let word = &body[ws..];
        let kw = ["endgeneration", "generation"].into_iter().find(|k| {
            word.strip_prefix(k).is_some_and(|after| {
                let t = after.trim_start().trim_start_matches(['-', '+']);
                t.starts_with("%}")
            })
        });
        if let Some(k) = kw {
            out.push_str(&rest[..lead + ws]);
            out.push_str(if k == "generation" {
                "if true"
            } else {
                "endif"
            });
            rest = &word[k.len()..];
        }
    }
    out.push_str(rest);
    out
}

/// `source` rendered over the JSON object `ctx` as a model's chat template is rendered:
/// the template fidelity test's entry, which compares it with Jinja2 itself.
/// `now` (Unix seconds) fixes what `strftime_now` sees, so a template that prints the
/// time renders the same text as a reference rendered at that instant.
pub fn render_source(source: &str, ctx: &str, now: Option<i64>) -> Result<String, Error> {
    use chrono::TimeZone;
    let ctx: Value = serde_json::from_str(ctx)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("context: {e}")))?;
    let clock = now.and_then(|t| chrono::Local.timestamp_opt(t, 0).single());
    render(&environment_at(source.to_owned(), clock)?, ctx, 0)
}

/// The chat template rendered over `ctx`, a panic inside the template engine turned into
/// an error: the context is a network peer's, and minijinja 2.x has panicked on inputs
/// before (its own slice indexed out of bounds on a reversed slice of nothing, which
/// `pyops` now does itself). Such a request is refused (counted, kept on the text chain)
/// and nothing else is touched: rendering holds no lock and shares no state.
/// `size_hint` is what the text is expected to take (the request body's length): a
/// coding agent's conversation is hundreds of KB, which growing by doubling would copy
/// about twice over.
pub fn render(t: &ChatTemplate, ctx: Value, size_hint: usize) -> Result<String, Error> {
    let run = || {
        t.program.with_dependent(|_, c| {
            let mut out = String::with_capacity(c.buffer_size_hint.max(size_hint));
            Vm::new(&t.env).eval(
                &c.instructions,
                ctx,
                &c.blocks,
                &mut make_string_output(&mut out),
                AutoEscape::None,
            )?;
            Ok(out)
        })
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|_| {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            "the template engine failed on this request",
        ))
    })
}

/// Python's `str.isspace` for one character: Unicode White_Space plus the four
/// information separators U+001C–U+001F.
pub(super) fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

#[derive(Clone, Copy)]
pub(super) enum Ends {
    Both,
    Start,
    End,
}

/// `s` stripped as Python strips it: of `chars` when given, else of whitespace.
pub(super) fn py_strip<'a>(s: &'a str, chars: Option<&str>, ends: Ends) -> &'a str {
    let hit = |c: char| match chars {
        Some(set) => set.contains(c),
        None => py_space(c),
    };
    match ends {
        Ends::Both => s.trim_matches(hit),
        Ends::Start => s.trim_start_matches(hit),
        Ends::End => s.trim_end_matches(hit),
    }
}

/// The value itself when nothing was stripped (strings are shared, not copied).
fn stripped(v: &Value, s: &str, out: &str) -> Value {
    if out.len() == s.len() {
        v.clone()
    } else if v.is_safe() {
        Value::from_safe_string(out.to_owned())
    } else {
        Value::from(out)
    }
}

/// Python's `str.split()` without a separator: runs of whitespace separate, ends ignored;
/// after `maxsplit` splits the rest is one item (its leading whitespace dropped).
fn py_split_whitespace(s: &str, maxsplit: Option<i64>) -> Value {
    let mut out = Vec::new();
    let mut rest = s.trim_start_matches(py_space);
    let mut left = maxsplit.filter(|n| *n >= 0);
    while !rest.is_empty() {
        if left == Some(0) {
            out.push(Value::from(rest));
            break;
        }
        let end = rest.find(py_space).unwrap_or(rest.len());
        out.push(Value::from(&rest[..end]));
        rest = rest[end..].trim_start_matches(py_space);
        left = left.map(|n| n - 1);
    }
    Value::from(out)
}

/// Python's `str.splitlines`: every line boundary Python knows (`\r\n` as one), no
/// empty item after a final boundary.
fn py_splitlines(s: &str, keepends: bool) -> Value {
    Value::from(
        py_lines(s, keepends)
            .into_iter()
            .map(Value::from)
            .collect::<Vec<_>>(),
    )
}

/// The lines Python's `str.splitlines` gives.
fn py_lines(s: &str, keepends: bool) -> Vec<&str> {
    let boundary = |c: char| {
        matches!(
            c,
            '\n' | '\r' | '\u{0b}' | '\u{0c}' | '\u{1c}'
                ..='\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        )
    };
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(at) = rest.find(boundary) {
        let end = if rest[at..].starts_with("\r\n") {
            at + 2
        } else {
            at + rest[at..].chars().next().map_or(1, char::len_utf8)
        };
        out.push(&rest[..if keepends { end } else { at }]);
        rest = &rest[end..];
    }
    if !rest.is_empty() {
        out.push(rest);
    }
    out
}

/// Jinja2's `indent(width=4, first=False, blank=False)`: the lines after the first
/// indented (empty ones only with `blank`), the first too with `first`; `width` is a
/// count of spaces or the indentation itself. Jinja2 appends a newline before splitting,
/// so a trailing newline survives (`'{\n' | indent(4, first=true)` is `'    {\n'`),
/// where minijinja's own `indent` drops it.
fn indent(
    v: Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = first
        .or(kwargs.get::<Option<bool>>("first")?)
        .unwrap_or(false);
    let blank = blank
        .or(kwargs.get::<Option<bool>>("blank")?)
        .unwrap_or(false);
    kwargs.assert_all_used()?;
    let Some(s) = v
        .as_str()
        .filter(|_| v.kind() == minijinja::value::ValueKind::String)
    else {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "indent: the value is not a string",
        ));
    };
    let ind = match &width {
        None => "    ".to_owned(),
        Some(w) if w.kind() == minijinja::value::ValueKind::String => {
            w.as_str().unwrap_or_default().to_owned()
        }
        Some(w) => " ".repeat(
            pyvalue::integer(w)
                .and_then(|n| usize::try_from(n.max(0)).ok())
                .filter(|n| *n <= 1 << 16)
                .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "indent: bad width"))?,
        ),
    };
    let with_newline = format!("{s}\n");
    let lines = py_lines(&with_newline, false);
    let mut out = String::with_capacity(with_newline.len() + lines.len() * ind.len());
    if first {
        out.push_str(&ind);
    }
    for (i, line) in lines.iter().enumerate() {
        if i > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(&ind);
            }
        }
        out.push_str(line);
    }
    Ok(if v.is_safe() {
        Value::from_safe_string(out)
    } else {
        Value::from(out)
    })
}

/// Jinja's `trim` filter (Python's `str.strip`).
fn trim(v: Value, chars: Option<String>) -> Value {
    match v.as_str() {
        Some(s) => stripped(&v, s, py_strip(s, chars.as_deref(), Ends::Both)),
        None => {
            let s = pyvalue::to_py_str(&v);
            Value::from(py_strip(&s, chars.as_deref(), Ends::Both))
        }
    }
}

/// Python's string methods with Python's whitespace; everything else as minijinja-contrib's
/// pycompat does it.
fn python_methods(
    state: &minijinja::State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    use minijinja::value::from_args;
    if let Some(s) = value.as_str() {
        let ends = match method {
            "strip" => Some(Ends::Both),
            "lstrip" => Some(Ends::Start),
            "rstrip" => Some(Ends::End),
            _ => None,
        };
        if let Some(ends) = ends {
            let (chars,): (Option<&str>,) = from_args(args)?;
            return Ok(stripped(value, s, py_strip(s, chars, ends)));
        }
        match method {
            "isspace" => {
                let () = from_args(args)?;
                return Ok(Value::from(!s.is_empty() && s.chars().all(py_space)));
            }
            "splitlines" => {
                let (keepends,): (Option<bool>,) = from_args(args)?;
                return Ok(py_splitlines(s, keepends.unwrap_or(false)));
            }
            "split" => {
                let (sep, maxsplit): (Option<Value>, Option<i64>) = from_args(args)?;
                if sep.as_ref().is_none_or(|v| v.is_none()) {
                    return Ok(py_split_whitespace(s, maxsplit));
                }
            }
            _ => {}
        }
    }
    if args.is_empty() {
        if let Some(view) = pyvalue::dict_view(value, method) {
            return Ok(view);
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime(now: chrono::DateTime<chrono::Local>, format: &str) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", now.format(format))
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
    if filters::is_generator(&v) || v.downcast_object_ref::<pyvalue::DictView>().is_some() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: a generator or dict view is not JSON serializable",
        ));
    }
    if v.is_undefined() {
        // json.dumps(Undefined) raises in Jinja2 (a missing tool description, say).
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: an undefined value is not JSON serializable",
        ));
    }
    let fail =
        |e: serde_json::Error| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    let mut buf = Vec::new();
    let fmt = PyFormatter {
        indent,
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    if sort_keys.unwrap_or(false) {
        let mut json = serde_json::to_value(&v).map_err(fail)?;
        sort(&mut json);
        json.serialize(&mut ser).map_err(fail)?;
    } else {
        // Straight from the template's value, not through a copy as a JSON tree (a
        // coding agent's tool definitions are tens of KB, printed on every turn).
        v.serialize(&mut ser).map_err(fail)?;
    }
    let s = String::from_utf8(buf)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    // A plain string, as transformers' `tojson` returns (Jinja2's own returns Markup):
    // `'…' | safe + x | tojson` escapes the JSON, as Python's `Markup.__add__` does.
    Ok(Value::from(s))
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

    /// `[` or `{`: one level deeper, nothing in it yet.
    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b)
    }

    /// `]` or `}`: on its own line (when indenting) unless the container was empty.
    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(b)
    }

    /// Before an array element or an object key: Python's separator, then the indent.
    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyFormatter {
    /// Python's float repr (`1e-07`, `1e+21`), not serde_json's (`1e-7`, `1e21`).
    fn write_f64<W: ?Sized + std::io::Write>(&mut self, w: &mut W, f: f64) -> std::io::Result<()> {
        let mut s = String::new();
        pyvalue::float_repr(f, &mut s);
        w.write_all(s.as_bytes())
    }
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _w: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
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
        let t = environment(src.to_string()).expect("template");
        super::render(&t, Value::from_serialize(ctx), 0).expect("render")
    }

    /// Each template renders `want` over the JSON object `ctx`.
    fn renders_as(ctx: &str, cases: &[(&str, &str)]) {
        for (src, want) in cases {
            let got = render_source(src, ctx, None).map_err(|e| e.to_string());
            assert_eq!(got.as_deref(), Ok(*want), "{src}");
        }
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
    fn whitespace_is_pythons() {
        // Python: "\x1fa b\x1c".strip() == "a b"; "".isspace() is False;
        // "  a b\x1e c  ".split(None, 1) == ["a", "b\x1e c  "].
        let ctx = serde_json::json!({"s": "\u{1f} a b\u{1c}", "t": "  a b\u{1e} c  ", "e": ""});
        assert_eq!(render("[{{ s | trim }}]", ctx.clone()), "[a b]");
        assert_eq!(render("[{{ s.strip() }}]", ctx.clone()), "[a b]");
        assert_eq!(render("[{{ s.lstrip() }}]", ctx.clone()), "[a b\u{1c}]");
        assert_eq!(render("[{{ s.rstrip() }}]", ctx.clone()), "[\u{1f} a b]");
        assert_eq!(
            render("[{{ s.strip('\u{1f}\u{1c}') }}]", ctx.clone()),
            "[ a b]"
        );
        assert_eq!(
            render("[{{ s | trim('\u{1f}') }}]", ctx.clone()),
            "[ a b\u{1c}]"
        );
        assert_eq!(
            render(
                "{{ e.isspace() }}{{ t.isspace() }}{{ '\u{1d} '.isspace() }}",
                ctx.clone()
            ),
            "FalseFalseTrue"
        );
        assert_eq!(
            render("{{ t.split() | tojson }}", ctx.clone()),
            r#"["a", "b", "c"]"#
        );
        assert_eq!(
            render("{{ t.split(none, 1) | tojson }}", ctx.clone()),
            r#"["a", "b\u001e c  "]"#
        );
        assert_eq!(render("{{ t.split(' ') | length }}", ctx.clone()), "7");
        assert_eq!(render("{{ 12 | trim }}", ctx), "12");
        // Python: "a\rb\r\nc\x0bd\x1ce\u2028f\n".splitlines() == ["a","b","c","d","e","f"].
        let lines = serde_json::json!({"l": "a\rb\r\nc\u{0b}d\u{1c}e\u{2028}f\n", "e": ""});
        assert_eq!(
            render(
                "{{ l.splitlines() | tojson }}|{{ e.splitlines() | length }}",
                lines.clone()
            ),
            r#"["a", "b", "c", "d", "e", "f"]|0"#
        );
        assert_eq!(
            render("{{ l.splitlines(true) | tojson }}", lines),
            "[\"a\\r\", \"b\\r\\n\", \"c\\u000b\", \"d\\u001c\", \"e\u{2028}\", \"f\\n\"]"
        );
    }

    /// Tuple literals, `dict.items()` and the `items` filter print as Python's tuples and
    /// views; calls, macro signatures and assignment targets keep their parentheses
    /// (each expectation is what Jinja2 3.1 under transformers renders).
    #[test]
    fn tuples_and_dict_views_are_pythons() {
        renders_as(
            r#"{"d": {"k": 1}}"#,
            &[
            ("{{ ('t', 1) }}|{{ (1,) }}|{{ () }}|{{ (1) }}", "('t', 1)|(1,)|()|1"),
            (
                "{% for (a, b) in d.items() %}{{ a }}={{ b }};{% endfor %}{% for a, b in d | items %}{{ a }}{{ b }}{% endfor %}",
                "k=1;k1",
            ),
            (
                "{{ d.items() }}|{{ d.keys() }}|{{ d.values() | list }}|{{ d | items | list }}|{{ d.items() | length }}",
                "dict_items([('k', 1)])|dict_keys(['k'])|[1]|[('k', 1)]|1",
            ),
            (
                "{% macro f(a, b) %}{{ a }}{{ b }}{% endmacro %}{{ f(1, 2) }}|{{ 'a' in ('a', 'b') }}|{{ ('x', 'y') | join('-') }}",
                "12|True|x-y",
            ),
            (
                "{% set a, b = (1, 2) %}{{ a }}{{ b }}|{{ [(1, 2)] }}|{{ {'k': (1, 2)} }}|{{ ('a', 'b')[1] }}|{{ d.items() is sequence }}",
                "12|[(1, 2)]|{'k': (1, 2)}|b|False",
            ),
            ],
        );
    }

    /// The operators' filter slots come after the template's own (pyops.rs mirrors
    /// minijinja's slot count, which its machinery does not export): with 48 filters
    /// named (never run, still given slots 0-47 by the compiler), the subscript and the
    /// slice take slots 48 and 49, the last ones, and the rest are looked up each time.
    #[test]
    fn operator_slots_stay_inside_minijinjas() {
        let named: String = (0..48).map(|i| format!("{{{{ x | f{i} }}}}")).collect();
        // Variables, not literals: minijinja folds constant expressions at compile time.
        let src = format!(
            "{{% if false %}}{named}{{% endif %}}{{{{ l[0] }}}}{{{{ s[::-1] }}}}{{{{ n + 1 }}}}"
        );
        let ctx = r#"{"l": [1, 2], "s": "ab", "n": 1}"#;
        assert_eq!(
            render_source(&src, ctx, None)
                .map_err(|e| e.to_string())
                .as_deref(),
            Ok("1ba2")
        );
    }

    /// Operators between literals run at render time, with Python's semantics, instead of
    /// being folded by minijinja's compiler (expectations from Jinja2 3.1).
    #[test]
    fn literal_operators_are_pythons() {
        let ours = |src: &str| render_source(src, "{}", None).map_err(|e| e.to_string());
        assert_eq!(
            ours("{{ 7 // -2 }}|{{ -7 % 2 }}|{{ 'a' ~ none }}|{{ 2 ** 3 }}").as_deref(),
            Ok("-4|1|aNone|8")
        );
        assert!(ours("{{ 1 < 'a' }}").is_err());
        assert!(ours("{{ 1 in 'a1' }}").is_err());
        assert_eq!(
            ours("{{ 'x' ~ 'y' ~ 'z' }}|{{ 1 + 2 * 3 }}").as_deref(),
            Ok("xyz|7")
        );
    }

    /// Jinja2's `indent` keeps a trailing newline (Command R+'s tool-use template indents
    /// `'{\n'`), and a string marked safe added to a plain one escapes the plain one, as
    /// Python's `Markup` does (functionary v3.1 adds `tojson`'s plain output to one);
    /// each expectation is what Jinja2 3.1 under transformers renders.
    #[test]
    fn indent_and_markup_are_jinja2s() {
        renders_as(
            r#"{"d": {"k": "\""}}"#,
            &[
                ("[{{ '{\\n' | indent(4, first=true) }}]", "[    {\n]"),
                ("[{{ 'a\\n\\nb' | indent(2) }}]", "[a\n\n  b]"),
                ("[{{ 'a\\n\\nb' | indent(2, blank=true) }}]", "[a\n  \n  b]"),
                ("[{{ 'a\\nb' | indent('> ', true) }}]", "[> a\n> b]"),
                ("[{{ 'x' | indent(width=3, first=true) }}]", "[   x]"),
                (
                    "{{ 'a \"' | safe + '<b>' + d | tojson }}",
                    "a \"&lt;b&gt;{&#34;k&#34;: &#34;\\&#34;&#34;}",
                ),
                (
                    "{{ '<' + '>' }}|{{ ('<' | safe) ~ '>' }}|{{ 'x' | e + '\"' }}",
                    "<>|<>|x&#34;",
                ),
            ],
        );
    }

    #[test]
    fn a_reversed_slice_of_nothing_is_empty_as_in_python() {
        // minijinja 2.x's own slice indexes out of bounds here; the template's slices are
        // Python's (pyops.rs), and the render still catches a panic as a refusal.
        let src = "{% for m in messages[::-1] %}{{ m }}{% endfor %}[{{ c[::-1] }}]";
        assert_eq!(
            render_source(src, r#"{"messages": [], "c": ""}"#, None)
                .map_err(|e| e.to_string())
                .as_deref(),
            Ok("[]")
        );
        assert_eq!(
            render_source(src, r#"{"messages": ["a", "b"], "c": "xy"}"#, None)
                .map_err(|e| e.to_string())
                .as_deref(),
            Ok("ba[yx]")
        );
    }

    /// Jinja2's `select`/`selectattr`/`reject`/`rejectattr`/`map`/`items` are generators
    /// (each expectation is what Jinja2 3.1 under transformers renders).
    #[test]
    fn generator_filters_are_lazy_as_jinja2s() {
        let ctx = serde_json::json!({"m": [{"role": "user"}], "n": 2.5, "d": {"a": 1}});
        let try_render = |src: &str| {
            super::render(
                &environment(src.to_string()).expect("template"),
                Value::from_serialize(ctx.clone()),
                0,
            )
        };
        // Always true, even when nothing would come out.
        let src = "{% if m | selectattr('role', 'equalto', 'system') %}yes{% endif %}";
        assert_eq!(render(src, ctx.clone()), "yes");
        // Made over what it cannot iterate: fails only when iterated.
        assert_eq!(
            render("{% set g = n | map('string') %}ok", ctx.clone()),
            "ok"
        );
        assert!(try_render("{{ n | map('string') | list }}").is_err());
        assert!(try_render("{% for x in n | select %}{% endfor %}").is_err());
        // Run through: what a list would give; no length, no last item, no JSON.
        assert_eq!(
            render("{{ m | map(attribute='role') | join(',') }}", ctx.clone()),
            "user"
        );
        assert_eq!(render("{{ (d | items | list)[0][1] }}", ctx.clone()), "1");
        assert_eq!(render("{{ missing | items | list }}", ctx.clone()), "[]");
        assert_eq!(
            render("{{ (m | reject('none') | first).role }}", ctx.clone()),
            "user"
        );
        assert!(try_render("{{ m | select | length }}").is_err());
        assert!(try_render("{{ m | select | last }}").is_err());
        assert!(try_render("{{ m | select | tojson }}").is_err());
    }

    #[test]
    fn sources_read_as_jinja2_reads_them() {
        // CRLF and lone CR are newlines; transformers' generation block keeps its body and
        // its whitespace control.
        let src = "{% if x %}\r\nA\rB{%- generation -%}  C  {%- endgeneration %}\r\n{% endif %}";
        assert_eq!(
            render_source(src, r#"{"x": true}"#, None)
                .map_err(|e| e.to_string())
                .as_deref(),
            Ok("A\nBC")
        );
        assert_eq!(
            render_source(
                "{% generation %}{{ 1.5e-7 }}|{{ [1e21] | tojson }}{% endgeneration %}",
                "{}",
                None
            )
            .map_err(|e| e.to_string())
            .as_deref(),
            Ok("1.5e-07|[1e+21]")
        );
    }

    /// Each expectation is what Jinja2 3.1 under transformers does with the same source.
    #[test]
    fn a_loop_over_none_raises_as_in_jinja2() {
        let ctx = r#"{"n": null, "l": [1, 2], "m": [{"c": null}], "s": "ab", "d": {"k": 1}}"#;
        let ours = |src: &str| render_source(src, ctx, None).map_err(|e| e.to_string());
        // None raises, wherever the loop is and whatever follows its iterable.
        for src in [
            "{% for x in n %}{{ x }}{% endfor %}",
            "{%- for x in n if x -%}{{ x }}{%- else -%}e{%- endfor %}",
            "{% for m in m %}{% for x in m.c %}{% endfor %}{% endfor %}",
            "{% for x in l %}{% endfor %}{% for x in (n) recursive %}{% endfor %}",
        ] {
            let e = ours(src).expect_err(src);
            assert!(e.contains("not iterable"), "{src}: {e}");
        }
        // Everything else iterates as before: undefined is empty, a tuple target, a
        // filtered and conditional iterable, a string, a map, brackets inside the iterable,
        // a `for` and `in` that are only text, strings that look like tags.
        let same = [
            ("{% for x in missing %}{{ x }}{% else %}e{% endfor %}", "e"),
            (
                "{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}",
                "k=1",
            ),
            (
                "{% for x in l | reverse if x > 1 %}{{ x }}{% endfor %}",
                "2",
            ),
            (
                "{% for c in s %}{{ loop.revindex }}{{ c }}{% endfor %}",
                "2a1b",
            ),
            ("{% for k in d %}{{ k }}{% endfor %}", "k"),
            (
                "{% for x in [l[0], (l[1] if n else 3)] %}{{ x }}{% endfor %}",
                "13",
            ),
            (
                "for x in n {{ 'for x in n' }}{# {% for x in n %} #}",
                "for x in n for x in n",
            ),
            (
                "{% raw %}{% for x in n %}{% endraw %}ok",
                "{% for x in n %}ok",
            ),
            ("{% for x in 1, 2 %}{{ x }}{% endfor %}", "12"),
        ];
        for (src, want) in same {
            assert_eq!(ours(src).as_deref(), Ok(want), "{src}");
        }
    }

    /// Jinja2's filters that iterate their input raise on None, as Python's `iter()` does;
    /// `sequence` is Python's (each expectation is Jinja2 3.1's under transformers).
    #[test]
    fn filters_that_iterate_refuse_none_as_jinja2s_do() {
        let ours =
            |src: &str| render_source(src, r#"{"l": [1, 2]}"#, None).map_err(|e| e.to_string());
        for f in [
            "list",
            "reverse",
            "join",
            "unique | list",
            "sort",
            "batch(2) | list",
            "sum",
            "min",
            "max",
        ] {
            let src = format!("{{{{ none | {f} }}}}");
            assert!(ours(&src).is_err(), "{src}");
        }
        renders_as(
            r#"{"l": [1, 2]}"#,
            &[
                ("{{ missing | reverse | list }}", "[]"),
                ("{{ missing | join }}|{{ missing | list }}", "|[]"),
                ("{{ l | reverse | list }}{{ l | sum }}{{ l | max }}", "[2, 1]32"),
                (
                    "{{ missing is sequence }} {{ {} is sequence }} {{ 's' is sequence }} {{ l is sequence }}",
                    "True True True True",
                ),
                ("{{ none is sequence }} {{ 1 is sequence }} {{ (l | select) is sequence }}", "False False False"),
            ],
        );
    }

    #[test]
    fn raise_exception_fails_the_render() {
        let t = environment("{{ raise_exception('no system role') }}".into()).expect("t");
        let e =
            super::render(&t, Value::from_serialize(serde_json::json!({})), 0).expect_err("raises");
        assert!(e.to_string().contains("no system role"), "{e}");
    }
}
