//! Statements from a person or a script: the interactive prompt of `arrow-cuda query` (rustyline,
//! with history and statements over several lines) and statements read from stdin. Both cut their
//! input into SQL statements ending at `;` and backslash commands, and run them through one
//! [`Session`].

use std::io::BufRead;
use std::path::PathBuf;

use rustyline::completion::Completer;
use rustyline::error::ReadlineError;
use rustyline::highlight::Highlighter;
use rustyline::hint::Hinter;
use rustyline::history::FileHistory;
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Editor, Helper};

use crate::query::Session;

/// The backslash commands, as `\?` lists them.
macro_rules! commands {
    () => {
        "  \\d          list the tables (name, type, rows, bytes)
  \\d NAME     describe table NAME (its columns and types)
  \\timing     turn off (or on) the rows and time printed after each statement (on at first);
              \\timing on, \\timing off
  \\q          quit (so does Ctrl-D)
  \\?          this help"
    };
}

/// What `arrow-cuda query --help` says after the options: the prompt and scripts.
pub const ABOUT: &str = concat!(
    "With no query, statements come from an interactive prompt when stdin is a terminal, else from
stdin as a script. A statement ends at `;` and may take several lines; at the prompt, Ctrl-C drops
the statement being typed, an error is printed and the prompt goes on, and the history is kept in
$XDG_STATE_HOME/arrow-cuda/history (~/.local/state/arrow-cuda/history). A script runs every
statement; the command fails when any did. Both take these commands, each on a line of its own:

",
    commands!(),
    "

Example: echo 'select count(*) from lineitem;' | arrow-cuda query --tpch 0.1"
);

/// The interactive prompt: reads statements and commands until `\q` or Ctrl-D, printing each
/// error and going on; runs each query `runs` times.
pub fn interactive(session: &mut Session, runs: usize) -> Result<(), Box<dyn std::error::Error>> {
    let mut editor: Editor<Sql, FileHistory> = Editor::new()?;
    editor.set_helper(Some(Sql));
    let history = history_path();
    if let Some(path) = &history {
        match editor.load_history(path) {
            Err(ReadlineError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("arrow-cuda: history not read from {}: {e}", path.display()),
            Ok(()) => {}
        }
    }
    eprintln!(
        "arrow-cuda {} on {}: statements end with `;`, \\? for help, \\q to quit",
        env!("CARGO_PKG_VERSION"),
        session.device()
    );
    let mut runner = Runner::new(session, runs);
    loop {
        match editor.readline("arrow-cuda> ") {
            Ok(input) if input.trim().is_empty() => {}
            Ok(input) => {
                editor.add_history_entry(input.as_str())?;
                if let Flow::Quit = runner.input(&input) {
                    break;
                }
            }
            // Ctrl-C drops what was typed.
            Err(ReadlineError::Interrupted) => {}
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(path) = &history {
        let saved = match path.parent() {
            Some(dir) => std::fs::create_dir_all(dir).map_err(ReadlineError::from),
            None => Ok(()),
        };
        if let Err(e) = saved.and_then(|()| editor.save_history(path)) {
            eprintln!("arrow-cuda: history not saved to {}: {e}", path.display());
        }
    }
    Ok(())
}

/// Statements and commands read from `input` (stdin that is not a terminal) until its end or
/// `\q`, each run as the prompt runs it; fails when any failed, after running them all.
pub fn script(session: &mut Session, runs: usize, input: impl BufRead) -> Result<(), Box<dyn std::error::Error>> {
    let mut runner = Runner::new(session, runs);
    let mut pending = String::new();
    for line in input.lines() {
        pending.push_str(&line?);
        pending.push('\n');
        if complete(&pending) {
            let flow = runner.input(&pending);
            pending.clear();
            if let Flow::Quit = flow {
                break;
            }
        }
    }
    // A last statement without its `;`.
    if !pending.trim().is_empty() {
        runner.input(&pending);
    }
    match runner.failed {
        0 => Ok(()),
        n => Err(format!("{n} of {} statements failed", runner.count).into()),
    }
}

/// Whether the prompt goes on after an input.
enum Flow {
    Go,
    Quit,
}

/// Runs the inputs of the prompt or a script on a [`Session`], counting them and their failures.
struct Runner<'a> {
    session: &'a mut Session,
    runs: usize,
    /// Statements and commands run so far: the label of a result's file with `--output`.
    count: usize,
    failed: usize,
}

impl<'a> Runner<'a> {
    fn new(session: &'a mut Session, runs: usize) -> Self {
        Runner {
            session,
            runs,
            count: 0,
            failed: 0,
        }
    }

    /// Runs a complete input (see [`complete`]): a command, or SQL statements, printing the error
    /// of each that fails.
    fn input(&mut self, text: &str) -> Flow {
        let text = text.trim();
        if text.starts_with('\\') {
            self.count += 1;
            match self.command(text) {
                Ok(flow) => return flow,
                Err(e) => self.fail(e),
            }
            return Flow::Go;
        }
        let (statements, rest) = split(text);
        for sql in statements.into_iter().chain(rest) {
            self.count += 1;
            let output = self.session.output(&self.count.to_string(), true);
            if let Err(e) = self.session.execute(None, sql, self.runs, output.as_deref()) {
                self.fail(e);
            }
        }
        Flow::Go
    }

    fn fail(&mut self, e: Box<dyn std::error::Error>) {
        eprintln!("error: {e}");
        self.failed += 1;
    }

    /// Runs the backslash command `line`.
    fn command(&mut self, line: &str) -> Result<Flow, Box<dyn std::error::Error>> {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["\\q"] => return Ok(Flow::Quit),
            ["\\?"] => println!("{}", commands!()),
            ["\\d"] => self.session.list_tables()?,
            ["\\d", table] => self.session.execute(None, &format!("DESCRIBE {table}"), 1, None)?,
            ["\\timing"] => self.timing(!self.session.timing),
            ["\\timing", "on"] => self.timing(true),
            ["\\timing", "off"] => self.timing(false),
            _ => return Err(format!("unknown command `{line}` (\\? lists the commands)").into()),
        }
        Ok(Flow::Go)
    }

    fn timing(&mut self, on: bool) {
        self.session.timing = on;
        eprintln!("timing is {}", if on { "on" } else { "off" });
    }
}

/// Whether `text` is a whole input: a backslash command, or SQL whose last statement ends with
/// `;` (or nothing but blanks and comments).
fn complete(text: &str) -> bool {
    text.trim_start().starts_with('\\') || split(text).1.is_none()
}

/// The statements of `text` that end with `;` (without it; those of nothing but blanks and
/// comments left out), and the text after the last one unless that is blank. A `;` in a quoted
/// string or identifier, or in a `--` or `/* */` comment, ends nothing.
fn split(text: &str) -> (Vec<&str>, Option<&str>) {
    #[derive(Clone, Copy, PartialEq)]
    enum At {
        Code,
        Quoted(char),
        LineComment,
        BlockComment,
    }
    let mut statements = Vec::new();
    let (mut start, mut content, mut at) = (0, false, At::Code);
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let next = chars.peek().map(|&(_, n)| n);
        match (at, c, next) {
            (At::Code, '\'' | '"', _) => (at, content) = (At::Quoted(c), true),
            (At::Code, '-', Some('-')) => (at, _) = (At::LineComment, chars.next()),
            (At::Code, '/', Some('*')) => (at, _) = (At::BlockComment, chars.next()),
            (At::Code, ';', _) => {
                if content {
                    statements.push(text[start..i].trim());
                }
                (start, content) = (i + 1, false);
            }
            (At::Code, c, _) if !c.is_whitespace() => content = true,
            (At::Quoted(q), c, _) if c == q => at = At::Code,
            (At::LineComment, '\n', _) => at = At::Code,
            (At::BlockComment, '*', Some('/')) => (at, _) = (At::Code, chars.next()),
            _ => {}
        }
    }
    let open = matches!(at, At::Quoted(_) | At::BlockComment);
    let rest = (content || open).then(|| text[start..].trim());
    (statements, rest)
}

/// Where the prompt's history is kept: `$XDG_STATE_HOME/arrow-cuda/history`, else
/// `~/.local/state/arrow-cuda/history` (as the XDG base directories say).
fn history_path() -> Option<PathBuf> {
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|d| d.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))?;
    Some(state.join("arrow-cuda").join("history"))
}

/// rustyline's helper at the prompt: Enter ends the input only once it is [`complete`], so a
/// statement takes as many lines as it needs and is one entry of the history.
struct Sql;

impl Validator for Sql {
    fn validate(&self, ctx: &mut ValidationContext) -> rustyline::Result<ValidationResult> {
        Ok(match complete(ctx.input()) {
            true => ValidationResult::Valid(None),
            false => ValidationResult::Incomplete,
        })
    }
}

impl Completer for Sql {
    type Candidate = String;
}

impl Hinter for Sql {
    type Hint = String;
}

impl Highlighter for Sql {}

impl Helper for Sql {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_end_at_semicolons_outside_strings_and_comments() {
        let (statements, rest) = split("select 1;\nselect ';' -- a ; here\n, 2;  /* ; */ ;; select");
        assert_eq!(statements, ["select 1", "select ';' -- a ; here\n, 2"]);
        assert_eq!(rest, Some("select"));
        assert_eq!(
            split("select \"a;b\" from t; -- done\n"),
            (vec!["select \"a;b\" from t"], None)
        );
        assert_eq!(split("select 'it''s';"), (vec!["select 'it''s'"], None));
        // An open string or comment is not complete, even with nothing else in it.
        assert_eq!(split("select 'a;").1, Some("select 'a;"));
        assert_eq!(split("/* ;").1, Some("/* ;"));
    }

    #[test]
    fn an_input_is_complete_at_its_last_semicolon_or_as_a_command() {
        assert!(complete(""));
        assert!(complete("  -- nothing\n"));
        assert!(complete("select 1;\n"));
        assert!(complete(" \\d lineitem"));
        assert!(!complete("select 1"));
        assert!(!complete("select 1;\nselect\n"));
        assert!(!complete("select 1\n\\d"));
    }
}
