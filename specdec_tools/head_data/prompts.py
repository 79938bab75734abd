"""Training prompts for the default pair's EAGLE-3 feature head (`specdec train-head`).

The target (Qwen2.5-Coder-1.5B-Instruct) completes each prompt itself, as a chat-templated user
message, and the head learns the target's habits from those completions (self-distillation). The
set is kept distinct from every benchmark prompt set (specdec_tools/bench.py, bench_tracing.py):
480 prompts, 240 "code" (write from scratch, ~40% Python), 120 "edit", 60 "explain", 60 "chat".
"""

from __future__ import annotations

KINDS = ("code", "edit", "explain", "chat")


def _fenced(text: str, lang: str, code: str, code_first: bool = False) -> str:
    block = f"```{lang}\n{code.strip(chr(10))}\n```"
    return f"{block}\n\n{text}" if code_first else f"{text}\n\n{block}"


def _spread(groups: dict[str, list[str]]) -> list[str]:
    """All the groups' items, each group's spread evenly over the result (a stable order)."""
    keyed = [((i + 0.5) / len(items), g, i) for g, items in enumerate(groups.values()) for i in range(len(items))]
    lists = list(groups.values())
    return [lists[g][i] for _, g, i in sorted(keyed)]


# write-from-scratch tasks, by language (interleaved below in proportion)
_CODE = {
    "python": [
        "Write a Python function that returns the n-th prime number, using a sieve that grows when it runs out.",
        "Write `chunked(iterable, size)` in Python: it should yield lists of at most `size` items and work with "
        "generators, not only with sequences.",
        "Implement a trie in Python with insert, search and starts_with methods.",
        "Write a Python script that walks a directory tree and reports empty folders and broken symlinks.",
        "Convert a Roman numeral string to an integer in Python. Invalid numerals such as 'IIV' or 'MMMM' should "
        "raise ValueError.",
        "Write an asyncio program that fetches a list of URLs with aiohttp, at most 5 at a time (use a semaphore), "
        "and prints the status code of each.",
        "Create a `Matrix` class in pure Python (no numpy) that supports +, matrix multiplication with the @ "
        "operator, transpose() and a readable __repr__.",
        'Flatten an arbitrarily nested dict into dot-separated keys in Python, e.g. {"a": {"b": 1}} becomes '
        '{"a.b": 1}. Lists should be indexed like "a.0".',
        "Write a command-line tool in Python (argparse) that renames every file in a folder to lowercase. Add a "
        "--dry-run flag that only prints what would change, and refuse to overwrite existing files.",
        "Validate an IPv4 address string in Python without using the ipaddress module. Leading zeros are invalid.",
        "Implement Dijkstra's algorithm in Python with heapq. The graph is a dict mapping each node to a list of "
        "(neighbor, weight) tuples; return both the distances and a way to rebuild the path.",
        "Write a function `is_valid_isbn10(s)` and pytest tests for it, with parametrized valid and invalid "
        "cases (hyphens allowed, 'X' only as the last character).",
        "I need a Python context manager that temporarily changes the current working directory and always "
        "changes it back, even when the block raises.",
        "Write a Python decorator `retry(times=3, delay=0.5, exceptions=(Exception,))` that retries the wrapped "
        "function when it raises one of the given exceptions, sleeping between attempts.",
        'Read a JSON Lines file in Python and return the records whose "status" field equals "error", '
        "skipping lines that are not valid JSON.",
        "Make a two-player tic-tac-toe game for the terminal in Python.",
        "Compute the Levenshtein distance between two strings in Python using dynamic programming with only two "
        "rows of memory.",
        "Implement a thread-safe bounded queue in Python with threading.Condition (don't use queue.Queue). It "
        "needs put and get with optional timeouts.",
        'Write a Python function that turns a datetime into a friendly relative string like "3 minutes ago", '
        '"yesterday" or "in 2 days".',
        "Build a small FastAPI app with POST /items and GET /items. Validate the body with Pydantic: name is a "
        "non-empty string, price a float greater than 0, tags a list of strings. Keep items in memory.",
        "Load settings from a TOML file in Python (tomllib), then let environment variables prefixed with APP_ "
        "override them, e.g. APP_DB__HOST overrides db.host.",
        "Write a regex for dates in YYYY-MM-DD format and a Python function that extracts all of them from a "
        "text as date objects, ignoring impossible dates like 2023-02-30.",
        "Implement a min-heap class from scratch in Python with push, pop, peek and __len__.",
        "Write a Python script that downloads a web page with urllib and prints every link (href) on it as an "
        "absolute URL, without duplicates.",
        "Rotate an n x n matrix (a list of lists) 90 degrees clockwise in place, in Python.",
        "Generate all permutations of a string in Python without itertools. Duplicate letters should not "
        "produce duplicate permutations.",
        "Write a BankAccount class in Python with deposit, withdraw (raise on overdraft) and a balance property, "
        "plus a unittest.TestCase that covers it.",
        'Format a number of seconds as a compact duration string in Python, e.g. 7509 -> "2h 05m 09s" and '
        '42 -> "42s".',
        "Create a small Tkinter app with a multi-line text box and a button that shows the number of words and "
        "characters in a label.",
        "Given a 9x9 Sudoku board as a list of lists with 0 for empty cells, write a Python function that "
        "reports whether the filled cells break any rule.",
        "Count the solutions of the N-Queens problem for a given n in Python, using backtracking with sets for "
        "the columns and diagonals.",
        "Write a word-wrapping function in Python that splits text into lines of at most `width` characters "
        "without breaking words (don't use textwrap). Words longer than the width go on their own line.",
        "Use multiprocessing.Pool to compute the SHA-256 of every file in a directory in parallel and print "
        "them sorted by file name.",
        "Write a Polynomial class in Python with integer coefficients: evaluation with __call__, addition, "
        "multiplication, derivative() and a __str__ like 3x^2 - x + 4.",
        "Write an evaluator for arithmetic expressions with + - * /, unary minus and parentheses in Python, "
        "without eval: a tokenizer and a recursive descent parser.",
        "Write a Python script that follows a log file like `tail -f` and prints lines containing ERROR in red.",
        "Implement run-length encoding and decoding in Python (\"aaabcc\" <-> \"3a1b2c\").",
        "Find the longest common prefix of a list of strings in Python.",
        "Write a singly linked list class in Python with append, prepend, remove(value), __len__ and __iter__.",
        "Write a tiny URL shortener with Flask: a form takes a URL and returns a short code, GET /<code> "
        "redirects, and the mappings live in a dict.",
        "Compute the simple moving average of a list of numbers with a window size k in Python, in O(n).",
        "With pandas, turn a DataFrame of sales (date, region, revenue) into a pivot table of total revenue "
        "per month and region.",
        "Check whether two strings are anagrams of each other in Python, ignoring case, spaces and punctuation.",
        "Send an email with a PDF attachment from Python using smtplib and STARTTLS; read the password from an "
        "environment variable.",
        "Implement a token bucket rate limiter class in Python with a method allow() that returns True or False.",
        "Write a Python function that converts a Markdown table (as a string) into a list of dicts keyed by the "
        "header cells.",
        "Read a large binary file in fixed-size chunks in Python and yield them one by one.",
        "Find all pairs of numbers in a list that add up to a target in O(n), in Python. Each pair once.",
        "Implement Conway's Game of Life in Python on a fixed-size grid and print each generation with # and .",
        "Write a Python function that prints a list of rows as an ASCII table with borders and column widths "
        "fitted to the content.",
        'Write `parse_duration("1h30m15s")` in Python returning a timedelta. Support h, m, s and ms in any '
        "combination and raise ValueError on anything else.",
        "Implement union-find (disjoint set) in Python with path compression and union by rank.",
        "Write a Stopwatch class in Python that works as a context manager and also has start(), stop() and "
        "lap() methods, using time.perf_counter.",
        "Simulate 100,000 rolls of two dice in Python and print the distribution of the sums as a text "
        "histogram.",
        "Write an async Python function that runs several coroutines with an overall timeout, returns the "
        "results of those that finished and cancels the rest.",
        "Convert camelCase and PascalCase identifiers to snake_case in Python, handling acronyms like "
        "HTTPServerError -> http_server_error.",
        "Using sqlite3, create a books table, insert a few rows and query the books published after 2000 "
        "ordered by title. Use parameterized queries.",
        "Write a minimal HTTP server with Python's http.server that answers GET /time with JSON containing the "
        "current UTC time in ISO format, and 404 for anything else.",
        "Find duplicate files in a directory tree in Python: group by size first, then compare hashes only "
        "within groups of equal size.",
        "Set up Python logging so that INFO and above go to the console and DEBUG and above go to a rotating "
        "file of 1 MB with 3 backups.",
        "Merge overlapping intervals in Python: given [[1, 3], [2, 6], [8, 10]] return [[1, 6], [8, 10]].",
        "Return the k most common words in a text, ignoring case and a given set of stop words (Python).",
        "Implement a small event emitter in Python with on, off, once and emit.",
        "Validate a credit card number with the Luhn algorithm in Python.",
        "Write a Python script that concatenates all the .csv files in a folder into one file, keeping a single "
        "header row and checking that the headers match.",
        "Write a Vector2 class in Python with +, -, multiplication by a scalar, ==, length() and normalized().",
        'Convert an integer to English words in Python, e.g. 1234 -> "one thousand two hundred thirty-four". '
        "Support numbers up to a billion.",
        "Detect a cycle in a directed graph (adjacency list) in Python and return one cycle as a list of nodes, "
        "or None.",
        "Write a topological sort in Python using Kahn's algorithm that raises a clear error when the graph "
        "has a cycle.",
        "Write a Python script that pings each host listed in a text file (one per line) with subprocess and "
        "prints which hosts are reachable.",
        "Without the calendar module, write a Python function that returns the weeks of a month as lists of "
        "day numbers, with 0 for padding, weeks starting on Monday.",
        "Implement producer-consumer with asyncio.Queue in Python: 3 producers, 2 consumers, and a clean "
        "shutdown once all the items are processed.",
        "Zip a directory in Python, skipping __pycache__ folders and .pyc files.",
        "Write `deep_merge(a, b)` in Python that recursively merges two dicts; values from b win, nested dicts "
        "are merged, and neither input is modified.",
        "Make a hangman game in Python for the terminal, with a list of words and six wrong guesses allowed.",
        "Implement a Bloom filter in Python with a configurable bit-array size and number of hash functions.",
        "Count the business days between two dates in Python, excluding weekends and a list of holidays.",
        "Write a simple tokenizer in Python that splits a line of source code into identifiers, numbers, "
        "string literals and operators using re.",
        "Write a Python script that samples CPU and memory usage every second with psutil and appends them to "
        "a file until it is stopped with Ctrl+C.",
        "Write pytest fixtures that create a temporary SQLite database with a users table, and two tests that "
        "use it.",
        "Find the median of an unsorted list in Python in expected linear time (quickselect).",
        "Write a class-based iterator in Python that yields the dates between two dates, stepping by a given "
        "number of days.",
        "Implement base64 encoding and decoding in Python without the base64 module.",
        "Rename the photos in a folder by the date they were taken (EXIF DateTimeOriginal) using Pillow.",
        "Check in Python whether a string of brackets ()[]{} is balanced.",
        "Return the power set of a list in Python.",
        "Download several files in parallel in Python with ThreadPoolExecutor and print progress as each one "
        "finishes.",
        "Implement the Caesar cipher in Python with encrypt and decrypt, preserving case and leaving non-letters "
        "alone.",
        "Write a tiny persistent key-value store in Python backed by a JSON file, with get, set and delete, and "
        "atomic writes (write to a temporary file, then rename).",
        "With numpy, normalize each row of a 2D array to unit length; rows of zeros should stay zero.",
        "Parse a URL query string into a dict of lists in Python without urllib.parse, decoding %XX escapes and "
        "+ as a space.",
        "Write a todo CLI with click: `todo add TEXT`, `todo list` and `todo done ID`, storing tasks in a JSON "
        "file in the user's home directory.",
        "Generate a random password in Python with the secrets module: a given length, and at least one "
        "uppercase letter, one lowercase letter, one digit and one symbol.",
        "Simulate a bank with 3 tellers in Python: customers arrive at random (exponential inter-arrival "
        "times) and each service takes a random time. Report the average wait.",
        "Compute the area of a polygon from its vertices with the shoelace formula in Python.",
        "Write a Python decorator that caches a function's results for a given number of seconds (a TTL cache).",
    ],
    "javascript": [
        "Write a JavaScript function that deep-clones a value, handling arrays, Dates, Maps, Sets and nested "
        "objects, without structuredClone.",
        "Write a generic TypeScript function `groupBy<T, K>(items: T[], key: (item: T) => K): Map<K, T[]>`.",
        "Write an Express.js server with routes to create, list and delete notes kept in memory. Use JSON "
        "bodies and the right status codes (201, 204, 404).",
        "Write a JavaScript helper that retries a promise-returning function with exponential backoff and "
        "jitter, up to a maximum number of attempts.",
        "Create a React component `Counter` with increment, decrement and reset buttons, using useState.",
        "Write a React hook `useFetch(url)` in TypeScript that returns { data, error, loading } and aborts the "
        "request when the component unmounts or the URL changes.",
        'Write `formatPrice(cents, currency)` in JavaScript returning strings like "$12.50" or "12,50 €" with '
        "Intl.NumberFormat, and jest tests for it.",
        "Write a Node.js script that prints a directory tree like the `tree` command, with an optional depth "
        "limit.",
        "Given a flat array of objects { id, parentId, name }, build a nested tree in JavaScript (roots have "
        "parentId null).",
        "Write a TypeScript EventBus class whose events are typed by a map from event names to payload types, "
        "so that `bus.emit('login', { userId: 1 })` is type-checked.",
        "Make an HTML table sortable by clicking on its column headers, in vanilla JavaScript. Clicking twice "
        "reverses the order; numbers should sort numerically.",
        "Write an email validation function in JavaScript with a pragmatic regex, and add a comment explaining "
        "what it deliberately does not check.",
        "In Node.js, compute the SHA-256 of a large file by streaming it through the crypto module.",
        'Parse semantic version strings like "1.2.3-beta.1" in TypeScript and write a compare function that '
        "follows the semver precedence rules.",
        "Implement a promise pool in JavaScript: run async tasks with at most N in flight and resolve with all "
        "the results in the original order.",
        'Format a Date as "YYYY-MM-DD HH:mm" in local time in JavaScript without any library.',
        "Build a snake game in JavaScript on an HTML canvas, controlled with the arrow keys.",
        "Model shapes (circle, rectangle, triangle) as a TypeScript discriminated union and write an area "
        "function with an exhaustiveness check using `never`.",
        "Write a JavaScript function that returns the intersection of two arrays, keeping each duplicate as "
        "many times as it appears in both.",
        'Write a Node.js CLI that takes a JSON file and a path like "a.b.0.c" and prints the value at that '
        "path, or exits with code 1 if it doesn't exist.",
        "Write a Vue 3 todo list component with the composition API: add items, toggle them, and filter by "
        "all, active and done.",
        "Implement infinite scroll in plain JavaScript: fetch /api/items?page=N when the user gets near the "
        "bottom of the page, using IntersectionObserver.",
        "Define a TypeScript type `DeepPartial<T>` and a function `withDefaults(config, defaults)` that fills "
        "a DeepPartial config from a full default object.",
        "Write a WebSocket chat server in Node.js with the ws package that broadcasts each message to every "
        "other connected client.",
    ],
    "go": [
        'Write a Go HTTP handler that accepts a JSON POST body with a "name" field and responds with a JSON '
        "greeting; return 400 for invalid JSON and 405 for other methods.",
        "Write a Go program that counts word frequencies in a file given on the command line and prints the "
        "10 most frequent words.",
        "Write a worker pool in Go: N goroutines read jobs from a channel, process them and send results to "
        "another channel; main waits with a sync.WaitGroup and closes the results channel.",
        "Implement a concurrency-safe counter map in Go with sync.RWMutex and methods Inc, Get and Snapshot.",
        "Write a Go function that reports whether a slice is sorted, first for []int and then as a generic "
        "version using cmp.Ordered.",
        "Write a Go CLI using the flag package that prints the MD5, SHA-1 and SHA-256 of a file, reading it "
        "only once.",
        "Write `Clamp(x, lo, hi int) int` in Go and table-driven tests for it.",
        "In Go, request several URLs concurrently with a per-request timeout using context, and print each "
        "response time.",
        "Write a Go struct for a service config loaded from a YAML file, applying defaults for missing fields "
        "and validating that the port is in range.",
        "Implement a generic Stack[T] and Queue[T] in Go.",
        'Parse log lines like `2024-05-01T12:00:00Z INFO user=alice action=login` in Go into a struct with a '
        "time.Time, a level and a map of fields.",
        "Write Go HTTP middleware that logs the method, path, status code and duration of every request.",
        "Write a Go HTTP server that shuts down gracefully on SIGINT or SIGTERM, giving in-flight requests 10 "
        "seconds to finish.",
        "Walk a directory in Go and return the total file size per file extension, sorted by size.",
    ],
    "rust": [
        "Count the occurrences of each character of a string in Rust and return a HashMap<char, usize>.",
        "Implement a generic Stack<T> in Rust with push, pop, peek and is_empty, plus unit tests.",
        "Write a Rust program that reads lines from stdin and prints them sorted and without duplicates.",
        "Write a Rust struct for a temperature with conversions between Celsius and Fahrenheit through the "
        "From trait.",
        'Parse "key=value" pairs separated by semicolons into a HashMap in Rust, returning a Result with a '
        "custom error type that implements std::error::Error.",
        "Sum a large Vec<u64> in Rust by splitting it across 4 threads with std::thread::scope.",
        "Write a wc-like CLI in Rust using clap: print the number of lines, words and bytes of each file given.",
        "Implement Display for a Rust struct representing a 3x3 tic-tac-toe board.",
        "Write an async Rust function using tokio and reqwest that downloads a URL to a file, streaming the "
        "body instead of loading it into memory.",
        "Return the n-th row of Pascal's triangle as a Vec<u64> in Rust.",
        "Define a Rust enum for JSON values and write a function that serializes it to a string, escaping "
        "strings correctly, without serde.",
        "Write a Rust iterator adapter that yields overlapping pairs (a, b), (b, c), ... from any iterator "
        "whose items are Clone.",
        "Write a Rust function that checks a password against several rules and returns every rule that "
        "failed, not only the first.",
        "Write a TCP echo server in Rust with std::net that handles each client in its own thread.",
    ],
    "c": [
        "Reverse a singly linked list in place in C, with a main that builds a list, reverses it and prints it.",
        "Write a C program that copies the file argv[1] to argv[2] with fread/fwrite and a 4 KiB buffer, "
        "checking every error.",
        "Implement a growable array of ints in C with push, get and free, doubling the capacity when full.",
        "Write `char *str_trim(char *s)` in C that removes leading and trailing whitespace in place.",
        "Implement a hash table in C with string keys and int values, using separate chaining.",
        "Write a C function that parses a decimal string into an int like atoi, but reports overflow and "
        "invalid characters to the caller.",
        "Use pthreads in C to sum an array of a million ints with 4 threads.",
        "Count the set bits of a 32-bit unsigned integer in C three ways: a simple loop, Kernighan's trick and "
        "a 256-entry lookup table.",
        "Write a C program that reads an integer from the user and prints its binary representation.",
        "Write C functions that check whether a year is a leap year and compute the day of the week of a date "
        "with Zeller's congruence.",
    ],
    "cpp": [
        "Write a C++ class template `RingBuffer<T, N>` with push, pop, full and empty.",
        "Write a C++17 program that reads numbers from a file and prints their mean, median and standard "
        "deviation.",
        "Find the first non-repeating character of a string in C++ using std::unordered_map.",
        "Write a C++ RAII wrapper around FILE* that closes the file in its destructor and is movable but not "
        "copyable.",
        "Write a C++ program where several std::threads append to a shared std::vector protected by a "
        "std::mutex.",
        "Use BFS in C++ to find the shortest path from S to E in a grid of characters, where # is a wall.",
        "Write a C++ Fraction class with +, -, *, /, comparisons and operator<<, always stored in lowest terms.",
        "Split a std::string by a delimiter character into a std::vector<std::string> in C++.",
        "Model bank accounts in C++ with inheritance: a base Account, a SavingsAccount that earns interest, and "
        "a CheckingAccount with an overdraft limit.",
        "Implement `bool isPrime(int n)` in C++ and write Google Test unit tests for it.",
    ],
    "java": [
        "Write a Java class Inventory that keeps products in a HashMap and supports add, remove and a method "
        "returning the products whose stock is below a threshold.",
        "Write a Java method that returns the longest line of a text file, using Files.lines.",
        "Implement a generic binary search tree in Java with insert, contains and an in-order traversal.",
        "Write a Spring Boot REST controller for /api/books with GET (all), GET /{isbn} and POST, backed by an "
        "in-memory list.",
        "Implement `StringCalculator.add(String numbers)` in Java, which sums comma- or newline-separated "
        "numbers, and write JUnit 5 tests for it.",
        "Use an ExecutorService in Java to run 10 tasks that each sleep for a random time and print their name, "
        "then shut the executor down cleanly.",
        "Write a Java record Point and a method that finds the closest pair in a list of points (brute force "
        "is fine).",
        'Convert a List<String> of dates in "dd/MM/yyyy" format into LocalDate objects in Java, skipping the '
        "invalid ones.",
        "Implement the Observer pattern in Java: a weather station that notifies displays when the temperature "
        "changes.",
        "Given a List<Employee>, use Java streams to compute the average salary per department, sorted by "
        "department name.",
        "Print all Armstrong numbers below 10000 in Java.",
        "Write a thread-safe lazy singleton in Java using the initialization-on-demand holder idiom.",
    ],
    "csharp": [
        "Write a C# LINQ query that returns the three most expensive products in each category.",
        "Write an async C# method that downloads several web pages in parallel with HttpClient and returns "
        "their lengths.",
        "Write an immutable C# Money type with an amount and a currency, where adding two amounts in different "
        "currencies throws.",
        "Write a C# console app that reads users from a JSON file with System.Text.Json and prints those older "
        "than 30.",
        "Write an ASP.NET Core minimal API with endpoints to add, list and complete todo items.",
        "Write C# extension methods `IsNullOrEmpty()` and `Batch(int size)` for IEnumerable<T>.",
        "Write a C# TemperatureConverter class and xUnit tests for it.",
        "Write a C# program that watches a folder with FileSystemWatcher and logs created, changed, renamed and "
        "deleted files.",
    ],
    "sql": [
        "Given employees(id, name, salary, manager_id), write a SQL query that finds the employees who earn more "
        "than their manager.",
        "Write a PostgreSQL query for the 7-day rolling average of daily signups from users(created_at), "
        "including days with no signups.",
        "Write the SQL DDL for a small library: books, members and loans, with primary keys, foreign keys and "
        "sensible constraints.",
        "Get the second highest distinct salary from employees in SQL, or NULL when there is none.",
        "Given orders(id, customer_id, created_at), find the customers who ordered in three consecutive "
        "calendar months (SQL).",
        "List the products that have never been ordered, given products(id, name) and order_items(order_id, "
        "product_id). Use NOT EXISTS.",
        "Using a window function, rank students by score within each class and return the top 3 of each class.",
        "Write a recursive CTE in PostgreSQL that returns every direct and indirect report of a given manager, "
        "with their depth in the hierarchy.",
        "Count page views per day and per country over the last 30 days from page_views(viewed_at, country).",
        "Write a PostgreSQL migration that adds a NOT NULL status column with a default to a large tickets "
        "table, plus an index on (status, created_at) built without locking writes.",
        "Find duplicate email addresses in a users table, ignoring case, with the number of times each appears.",
        "In SQLite, compute the total revenue per month of 2023 from a sales table and the month-over-month "
        "change in percent.",
    ],
    "bash": [
        "Write a bash script that backs up a directory to a timestamped .tar.gz and deletes backups older than "
        "7 days.",
        "Give me a shell one-liner that lists the 5 largest files under the current directory.",
        "Write a bash script that checks a list of URLs with curl and prints OK or FAIL in color for each one.",
        "Write a bash function `retry N DELAY command...` that retries a command up to N times.",
        "Write a bash script that changes the extension of every .jpeg file in a folder to .jpg.",
        "Write a bash script that parses options with getopts: -v for verbose, -o FILE for the output, then "
        "any number of input files.",
        "Write a bash script for cron that logs a warning to syslog when any mounted filesystem is over 90% "
        "full.",
        "Write an awk one-liner that sums the third column of a whitespace-separated file, grouped by the "
        "first column.",
        "Extract the unique client IPs from an nginx access log and count requests per IP, sorted by count, "
        "with standard shell tools.",
        "Write a bash script that waits until a TCP port is open on a host, with a timeout, before running a "
        "command.",
    ],
    "ruby": [
        "Write a Ruby class Recipe with ingredients and quantities, and a method that scales it to a different "
        "number of servings.",
        "Write a Ruby method that converts all the string keys of a nested hash into symbols.",
        "Write a Ruby script that reads a log file and prints how many lines there are per log level.",
        "Implement a Stack class in Ruby and write RSpec tests for it.",
        "Write a Sinatra app with a route that returns the server time as JSON.",
    ],
    "kotlin": [
        "Write a Kotlin data class User and a function that filters users by an age range and sorts them by "
        "name.",
        "With Kotlin coroutines, fetch three resources concurrently using async/await and combine the results.",
        "Write a Kotlin sealed class for the state of a network call (Loading, Success, Error) and a function "
        "that renders each state as text.",
        "Write a Kotlin extension function that capitalizes the first letter of every word in a string.",
        "In Kotlin, read a text file and return a map from word length to how many words have that length.",
    ],
    "swift": [
        "Write a generic Swift struct Stack<Element> with push, pop and peek that conforms to "
        "CustomStringConvertible.",
        "Decode JSON for a blog post with an array of comments into Codable Swift structs, mapping snake_case "
        "keys.",
        "Write a SwiftUI view that shows a list of tasks with a toggle for each one and a text field to add "
        "new tasks.",
        "Validate a username in Swift: 3 to 16 characters, only letters, digits and underscores, not starting "
        "with a digit.",
    ],
    "php": [
        "Write a PHP function that inserts a new user into MySQL with PDO prepared statements and a hashed "
        "password.",
        "Write a small PHP router class that maps GET and POST paths (with {id} parameters) to callbacks.",
        "Write a PHP script that reads products from a JSON file and renders them as an HTML table, escaping "
        "the output.",
        "Write a PHP function that paginates an array and returns the items of a page along with the total "
        "number of pages.",
    ],
    "web": [
        "Write HTML and CSS for a responsive pricing section with three cards side by side that stack on "
        "small screens.",
        "Build a CSS-only dropdown navigation menu that opens on hover and on keyboard focus.",
        "Write an HTML signup form with client-side validation (required fields, email type, password of at "
        "least 8 characters) and styled error messages.",
        "Write the CSS for a centered loading spinner animated with @keyframes.",
        "Lay out a page with CSS grid: header, sidebar, main content and footer, with the sidebar moving below "
        "the content on narrow screens.",
    ],
    "haskell": [
        "Write a Haskell function that returns the prime factors of an integer.",
        "Implement a binary search tree in Haskell with insert, member and an in-order fold.",
        "Write a Haskell program that reads numbers from stdin, one per line, and prints their sum and maximum.",
        "Write `collatz :: Int -> [Int]` in Haskell and find the starting number below 10000 with the longest "
        "sequence.",
    ],
    "other": [
        "Write a Lua function that serializes a table into a readable string, including nested tables.",
        "In R, fit a linear regression of mpg on weight with the mtcars data set and plot the fitted line over "
        "the points.",
        "Write a PowerShell script that lists the services that are stopped although their start type is "
        "Automatic.",
    ],
}
CODE = _spread(_CODE)

# (request, language, code): a code change asked about a snippet; every fourth one shows the code first
_EDIT = [
    (
        "This crashes when the API is down or answers with an error status. Add proper error handling "
        "(timeouts, HTTP errors, missing keys) and raise a custom UserLookupError instead.",
        "python",
        r"""
import requests


def get_user(user_id):
    resp = requests.get(f"https://api.example.com/users/{user_id}")
    data = resp.json()
    return data["name"], data["email"]
""",
    ),
    (
        "Add type hints to both functions without changing their behavior.",
        "python",
        r"""
def parse_range(text):
    parts = text.split("-")
    if len(parts) == 1:
        return [int(parts[0])]
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        start, end = end, start
    return list(range(start, end + 1))


def parse_ranges(spec):
    out = []
    for chunk in spec.split(","):
        chunk = chunk.strip()
        if chunk:
            out.extend(parse_range(chunk))
    return sorted(set(out))
""",
    ),
    (
        "Rewrite this with fs.promises and async/await instead of callbacks.",
        "javascript",
        r"""
const fs = require("fs");

function loadConfig(path, callback) {
  fs.readFile(path, "utf8", (err, text) => {
    if (err) {
      callback(err);
      return;
    }
    let config;
    try {
      config = JSON.parse(text);
    } catch (e) {
      callback(e);
      return;
    }
    callback(null, { port: 8080, ...config });
  });
}
""",
    ),
    (
        "Sometimes this returns before all the downloads have finished, and the sizes end up in the wrong "
        "slots. Find the bugs and fix them.",
        "go",
        r"""
func fetchAll(urls []string) []int {
    var wg sync.WaitGroup
    sizes := make([]int, len(urls))
    for i, u := range urls {
        go func() {
            wg.Add(1)
            defer wg.Done()
            resp, err := http.Get(u)
            if err != nil {
                return
            }
            defer resp.Body.Close()
            body, _ := io.ReadAll(resp.Body)
            sizes[i] = len(body)
        }()
    }
    wg.Wait()
    return sizes
}
""",
    ),
    (
        'Refactor this script into small functions with a main() and an `if __name__ == "__main__":` guard, '
        "and make sure the file gets closed.",
        "python",
        r"""
import json
import sys

data = json.load(open(sys.argv[1]))
total = 0
count = 0
for order in data["orders"]:
    if order["status"] != "cancelled":
        amount = order["quantity"] * order["unit_price"]
        if order.get("coupon"):
            amount *= 0.9
        total += amount
        count += 1
print("orders:", count)
print("revenue:", round(total, 2))
if count:
    print("per order:", round(total / count, 2))
""",
    ),
    (
        "Replace every unwrap() with real error handling: return Result<Vec<(String, u32)>, Box<dyn "
        "std::error::Error>> and mention the line number of malformed lines in the error.",
        "rust",
        r"""
use std::fs;

fn read_scores(path: &str) -> Vec<(String, u32)> {
    let text = fs::read_to_string(path).unwrap();
    let mut scores = Vec::new();
    for line in text.lines() {
        let mut parts = line.split(',');
        let name = parts.next().unwrap().trim().to_string();
        let score: u32 = parts.next().unwrap().trim().parse().unwrap();
        scores.push((name, score));
    }
    scores
}
""",
    ),
    (
        "Add SLF4J logging: info for successful charges with the transaction id, warn for rejected amounts, "
        "and error (with the exception) when the gateway fails.",
        "java",
        r"""
public class PaymentProcessor {
    private final Gateway gateway;

    public PaymentProcessor(Gateway gateway) {
        this.gateway = gateway;
    }

    public boolean charge(String customerId, long amountCents) {
        if (amountCents <= 0) {
            return false;
        }
        try {
            String txId = gateway.charge(customerId, amountCents);
            return txId != null;
        } catch (GatewayException e) {
            return false;
        }
    }
}
""",
    ),
    (
        "Write pytest tests for this function, covering the normal cases and the error case.",
        "python",
        r"""
def normalize_phone(raw: str) -> str:
    digits = "".join(ch for ch in raw if ch.isdigit())
    if digits.startswith("00"):
        digits = digits[2:]
    elif len(digits) == 10:
        digits = "1" + digits
    if not 11 <= len(digits) <= 15:
        raise ValueError(f"not a phone number: {raw!r}")
    return "+" + digits
""",
    ),
    (
        "This program crashes when the name is long. Fix it with snprintf and explain the change briefly.",
        "c",
        r"""
#include <stdio.h>
#include <string.h>

void greet(const char *name) {
    char buf[16];
    strcpy(buf, "Hello, ");
    strcat(buf, name);
    strcat(buf, "!");
    puts(buf);
}

int main(int argc, char **argv) {
    if (argc > 1) {
        greet(argv[1]);
    }
    return 0;
}
""",
    ),
    (
        "Add TypeScript interfaces for the orders and for the return value, and type the function strictly "
        "(no any).",
        "typescript",
        r"""
export function summarizeOrders(orders) {
  const byStatus = {};
  let revenue = 0;
  for (const o of orders) {
    byStatus[o.status] = (byStatus[o.status] || 0) + 1;
    if (o.status === "paid") {
      revenue += o.items.reduce((s, it) => s + it.price * it.qty, 0);
    }
  }
  return { byStatus, revenue };
}
""",
    ),
    (
        "Make this async with httpx.AsyncClient so that the sites are checked concurrently.",
        "python",
        r"""
import time

import requests


def check_sites(urls):
    results = {}
    for url in urls:
        start = time.time()
        try:
            r = requests.get(url, timeout=5)
            results[url] = (r.status_code, time.time() - start)
        except requests.RequestException:
            results[url] = (None, time.time() - start)
    return results
""",
    ),
    (
        "Both functions are very slow on lists of 100k elements. Optimize them, keeping the output order of "
        "common_elements the same.",
        "python",
        r"""
def common_elements(a, b):
    result = []
    for x in a:
        if x in b and x not in result:
            result.append(x)
    return result


def has_duplicates(items):
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            if items[i] == items[j]:
                return True
    return False
""",
    ),
    (
        "Translate this Python function to Go, with a small main that prints a few examples.",
        "python",
        r"""
def initials(full_name):
    parts = [p for p in full_name.replace("-", " ").split() if p]
    if not parts:
        return ""
    letters = [p[0].upper() for p in parts]
    if len(letters) > 3:
        letters = letters[:2] + letters[-1:]
    return ".".join(letters) + "."
""",
    ),
    (
        "Add an optional perPage parameter (default 10) and clamp page to the valid range.",
        "javascript",
        r"""
function paginate(items, page) {
  const perPage = 10;
  const start = (page - 1) * perPage;
  return {
    items: items.slice(start, start + perPage),
    page,
    totalPages: Math.ceil(items.length / perPage),
  };
}
""",
    ),
    (
        "Add Google-style docstrings to the class and its methods.",
        "python",
        r"""
class RateTable:
    def __init__(self, base_currency, rates):
        self.base = base_currency
        self.rates = dict(rates)
        self.rates[base_currency] = 1.0

    def convert(self, amount, src, dst):
        for code in (src, dst):
            if code not in self.rates:
                raise KeyError(f"unknown currency: {code}")
        return amount / self.rates[src] * self.rates[dst]

    def update(self, currency, rate):
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rates[currency] = rate
""",
    ),
    (
        "Rewrite this query with one JOIN and GROUP BY instead of the correlated subqueries.",
        "sql",
        r"""
SELECT p.id, p.name,
       (SELECT COUNT(*) FROM reviews r WHERE r.product_id = p.id) AS review_count,
       (SELECT AVG(r.rating) FROM reviews r WHERE r.product_id = p.id) AS avg_rating
FROM products p
WHERE (SELECT COUNT(*) FROM reviews r WHERE r.product_id = p.id) > 5
ORDER BY avg_rating DESC;
""",
    ),
    (
        "Make this deploy script safer: stop on the first error, fail on unset variables, log each step with a "
        "timestamp, and keep the previous static files if the build fails.",
        "bash",
        r"""
#!/bin/bash
cd /var/www/app
git pull
npm install
npm run build
cp -r dist/* /srv/static/
systemctl restart app
echo "Deployed"
""",
    ),
    (
        "Add a context.Context parameter, use QueryRowContext, and return a sentinel ErrUserNotFound when "
        "there is no such row.",
        "go",
        r"""
func lookupUser(db *sql.DB, id int64) (*User, error) {
    row := db.QueryRow("SELECT id, name, email FROM users WHERE id = ?", id)
    var u User
    if err := row.Scan(&u.ID, &u.Name, &u.Email); err != nil {
        return nil, err
    }
    return &u, nil
}
""",
    ),
    (
        "Modernize this class: use std::vector, make the accessors const, make get() bounds-checked (throw "
        "std::out_of_range) and drop the fixed capacity.",
        "cpp",
        r"""
#include <iostream>

class IntList {
public:
    IntList(int capacity) {
        data = new int[capacity];
        size = 0;
        cap = capacity;
    }
    ~IntList() { delete[] data; }
    void add(int v) {
        if (size < cap) data[size++] = v;
    }
    int get(int i) { return data[i]; }
    int count() { return size; }
private:
    int *data;
    int size;
    int cap;
};
""",
    ),
    (
        "Tags added to one article show up on other articles. Fix the bug and explain the cause in one or two "
        "sentences.",
        "python",
        r"""
def add_tag(tag, tags=[]):
    if tag not in tags:
        tags.append(tag)
    return tags


class Article:
    def __init__(self, title, tags=[]):
        self.title = title
        self.tags = tags

    def tag(self, t):
        self.tags = add_tag(t, self.tags)
""",
    ),
    (
        "Rewrite this method with the Stream API, keeping the result sorted by city.",
        "java",
        r"""
public static Map<String, Integer> countByCity(List<Customer> customers) {
    Map<String, Integer> result = new TreeMap<>();
    for (Customer c : customers) {
        if (c.isActive()) {
            String city = c.getCity().trim();
            if (result.containsKey(city)) {
                result.put(city, result.get(city) + 1);
            } else {
                result.put(city, 1);
            }
        }
    }
    return result;
}
""",
    ),
    (
        "Give this method and its variables descriptive names, and move the shipping rule into its own method.",
        "ruby",
        r"""
def calc(o)
  t = 0
  o[:lines].each do |l|
    t += l[:p] * l[:q]
  end
  t = t - (t * o[:d] / 100.0) if o[:d]
  t = t + 4.99 if t < 50
  t.round(2)
end
""",
    ),
    (
        "Port this to Rust as a function taking a slice of f64. Return an empty Vec when bins is 0.",
        "python",
        r"""
def histogram(values, bins, lo, hi):
    counts = [0] * bins
    width = (hi - lo) / bins
    for v in values:
        if v < lo or v >= hi:
            continue
        counts[int((v - lo) / width)] += 1
    return counts
""",
    ),
    (
        "Add logging with the logging module (a debug line for each moved file and an info summary at the "
        "end), and move the time import to the top of the module.",
        "python",
        r"""
import shutil
from pathlib import Path


def archive_old_reports(src, dst, days):
    import time
    cutoff = time.time() - days * 86400
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    moved = 0
    for path in Path(src).glob("*.pdf"):
        if path.stat().st_mtime < cutoff:
            shutil.move(str(path), dst / path.name)
            moved += 1
    return moved
""",
    ),
    (
        "Write jest tests for parseCookie, including empty input, encoded values and malformed parts.",
        "javascript",
        r"""
export function parseCookie(header) {
  const out = {};
  if (!header) return out;
  for (const part of header.split(";")) {
    const idx = part.indexOf("=");
    if (idx === -1) continue;
    const key = part.slice(0, idx).trim();
    const value = decodeURIComponent(part.slice(idx + 1).trim());
    if (key) out[key] = value;
  }
  return out;
}
""",
    ),
    (
        "Write table-driven tests for Truncate, including strings with multi-byte characters.",
        "go",
        r"""
package textutil

import "strings"

func Truncate(s string, max int) string {
    if max <= 0 {
        return ""
    }
    r := []rune(s)
    if len(r) <= max {
        return s
    }
    if max <= 3 {
        return string(r[:max])
    }
    return strings.TrimSpace(string(r[:max-3])) + "..."
}
""",
    ),
    (
        "Make BuildReport properly async (no .Result), fetch the items concurrently, and keep the lines in the "
        "original order.",
        "csharp",
        r"""
public class ReportService
{
    private readonly HttpClient _http = new HttpClient();

    public string BuildReport(IEnumerable<string> ids)
    {
        var sb = new StringBuilder();
        foreach (var id in ids)
        {
            var json = _http.GetStringAsync($"https://api.example.com/items/{id}").Result;
            var item = JsonSerializer.Deserialize<Item>(json);
            sb.AppendLine($"{item.Name}: {item.Price:C}");
        }
        return sb.ToString();
    }
}
""",
    ),
    (
        "sliding_max([1, 3, 2, 5], 2) returns [3, 3] instead of [3, 3, 5]. Fix the bug, then make it O(n) with "
        "a deque.",
        "python",
        r"""
def sliding_max(values, k):
    result = []
    for i in range(len(values) - k):
        result.append(max(values[i:i + k]))
    return result
""",
    ),
    (
        "Rewrite this with pathlib instead of os and os.path, returning Path objects.",
        "python",
        r"""
import os


def find_images(root):
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            ext = os.path.splitext(name)[1].lower()
            if ext in (".png", ".jpg", ".jpeg", ".gif"):
                full = os.path.join(dirpath, name)
                found.append((full, os.path.getsize(full)))
    found.sort(key=lambda t: t[1], reverse=True)
    return found
""",
    ),
    (
        "Handle network errors, non-OK responses and unexpected response shapes, encode the city in the URL, "
        "and give the function a typed return value.",
        "typescript",
        r"""
async function getWeather(city: string) {
  const res = await fetch(`https://api.example.com/weather?q=${city}`);
  const body = await res.json();
  return {
    temp: body.main.temp,
    description: body.weather[0].description,
  };
}
""",
    ),
    (
        "Add a parameter `n` for how many words to return, break ties alphabetically so that the output is "
        "deterministic, and add a doc comment.",
        "rust",
        r"""
fn top_words(text: &str) -> Vec<(String, usize)> {
    let mut counts = std::collections::HashMap::new();
    for word in text.split_whitespace() {
        *counts.entry(word.to_lowercase()).or_insert(0) += 1;
    }
    let mut pairs: Vec<_> = counts.into_iter().collect();
    pairs.sort_by(|a, b| b.1.cmp(&a.1));
    pairs.truncate(10);
    pairs
}
""",
    ),
    (
        "Replace the if/elif chain with a dispatch table of small functions, and check the number of arguments "
        "each command gets.",
        "python",
        r"""
def handle(command, args, store):
    if command == "get":
        return store.get(args[0])
    elif command == "set":
        store[args[0]] = args[1]
        return "OK"
    elif command == "del":
        return store.pop(args[0], None) is not None
    elif command == "keys":
        return sorted(store)
    elif command == "count":
        return len(store)
    else:
        raise ValueError("unknown command " + command)
""",
    ),
    (
        "Why does contains return false here? Fix the class, and consider whether it should be a record.",
        "java",
        r"""
public class Coordinate {
    private final int x;
    private final int y;

    public Coordinate(int x, int y) {
        this.x = x;
        this.y = y;
    }

    public boolean equals(Coordinate other) {
        return other != null && x == other.x && y == other.y;
    }
}

// Set<Coordinate> visited = new HashSet<>();
// visited.add(new Coordinate(1, 2));
// visited.contains(new Coordinate(1, 2))  -> false
""",
    ),
    (
        "Convert this bash script to a Python script that prints the same output.",
        "bash",
        r"""
#!/usr/bin/env bash
for f in logs/*.log; do
  errors=$(grep -c "ERROR" "$f")
  warns=$(grep -c "WARN" "$f")
  if [ "$errors" -gt 0 ]; then
    echo "$f: $errors errors, $warns warnings"
  fi
done | sort -t: -k2 -nr
""",
    ),
    (
        "Replace these dictionaries with a frozen dataclass Event, and turn duration_minutes and overlaps into "
        "methods.",
        "python",
        r"""
def make_event(name, start, end, attendees=None):
    return {
        "name": name,
        "start": start,
        "end": end,
        "attendees": attendees or [],
    }


def duration_minutes(event):
    return (event["end"] - event["start"]).total_seconds() / 60


def overlaps(a, b):
    return a["start"] < b["end"] and b["start"] < a["end"]
""",
    ),
    (
        "Check every call that can fail, return NULL on failure without leaking anything, and document who "
        "owns the returned buffer.",
        "c",
        r"""
char *read_file(const char *path, long *out_len) {
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc(len + 1);
    fread(buf, 1, len, f);
    buf[len] = '\0';
    fclose(f);
    *out_len = len;
    return buf;
}
""",
    ),
    (
        "Turn this into an ES class Cart so that several carts can exist at once, and reject quantities that "
        "are not positive integers.",
        "javascript",
        r"""
let cart = [];

function addItem(name, price, qty) {
  const existing = cart.find((i) => i.name === name);
  if (existing) existing.qty += qty;
  else cart.push({ name, price, qty });
}

function removeItem(name) {
  cart = cart.filter((i) => i.name !== name);
}

function total() {
  return cart.reduce((s, i) => s + i.price * i.qty, 0);
}
""",
    ),
    (
        "This takes minutes on a DataFrame with a million rows. Vectorize it (pd.cut or numpy) and keep the "
        "same labels.",
        "python",
        r"""
import pandas as pd


def add_age_group(df):
    groups = []
    for _, row in df.iterrows():
        if row["age"] < 18:
            groups.append("minor")
        elif row["age"] < 65:
            groups.append("adult")
        else:
            groups.append("senior")
    df["age_group"] = groups
    return df
""",
    ),
    (
        "Use a Config struct instead of map[string]interface{}, move the loading into a loadConfig function "
        "that returns an error, and check the error from Unmarshal.",
        "go",
        r"""
func main() {
    data, err := os.ReadFile("config.json")
    if err != nil {
        panic(err)
    }
    var cfg map[string]interface{}
    json.Unmarshal(data, &cfg)
    port := cfg["port"].(float64)
    host := cfg["host"].(string)
    addr := fmt.Sprintf("%s:%d", host, int(port))
    http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
        fmt.Fprintln(w, "ok")
    })
    log.Fatal(http.ListenAndServe(addr, nil))
}
""",
    ),
    (
        "Write unittest tests for this class (unittest, not pytest).",
        "python",
        r"""
class ShoppingList:
    def __init__(self):
        self._items = {}

    def add(self, name, qty=1):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self._items[name] = self._items.get(name, 0) + qty

    def remove(self, name, qty=1):
        have = self._items.get(name, 0)
        if qty >= have:
            self._items.pop(name, None)
        else:
            self._items[name] = have - qty

    def __len__(self):
        return sum(self._items.values())
""",
    ),
    (
        "Remove the try! calls: make the function throw a ProfileError with separate cases for a missing file "
        "and for invalid JSON.",
        "swift",
        r"""
func loadProfile(from path: String) -> Profile {
    let url = URL(fileURLWithPath: path)
    let data = try! Data(contentsOf: url)
    let profile = try! JSONDecoder().decode(Profile.self, from: data)
    return profile
}
""",
    ),
    (
        "Add argparse options for the number of words, the separator and how many passphrases to print, and "
        "use the secrets module instead of random.",
        "python",
        r"""
import random

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "pixel"]


def make_passphrase():
    words = random.sample(WORDS, 4)
    return "-".join(words)


if __name__ == "__main__":
    print(make_passphrase())
""",
    ),
    (
        "Fix the SQL injection and the XSS hole in this code.",
        "php",
        r"""
<?php
function findUser($pdo, $email) {
    $sql = "SELECT id, name FROM users WHERE email = '" . $email . "'";
    $result = $pdo->query($sql);
    return $result->fetch(PDO::FETCH_ASSOC);
}

$user = findUser($pdo, $_GET['email']);
echo "Hello " . $user['name'];
""",
    ),
    (
        "Convert this Java class to idiomatic Kotlin.",
        "java",
        r"""
public class Book {
    private final String isbn;
    private final String title;
    private final int year;
    private boolean borrowed;

    public Book(String isbn, String title, int year) {
        if (isbn == null || isbn.isBlank()) {
            throw new IllegalArgumentException("isbn is required");
        }
        this.isbn = isbn;
        this.title = title;
        this.year = year;
    }

    public String getIsbn() { return isbn; }
    public String getTitle() { return title; }
    public int getYear() { return year; }
    public boolean isBorrowed() { return borrowed; }

    public void borrow() {
        if (borrowed) throw new IllegalStateException("already borrowed");
        borrowed = true;
    }

    public void giveBack() { borrowed = false; }
}
""",
    ),
    (
        "progress_bar(15, 30) shows an empty bar and 0%. Fix it, and handle total == 0.",
        "python",
        r"""
def progress_bar(done, total, width=30):
    filled = done // total * width
    bar = "#" * filled + "-" * (width - filled)
    percent = done // total * 100
    return f"[{bar}] {percent}%"
""",
    ),
    (
        "Convert this class component to a function component with hooks.",
        "jsx",
        r"""
class Clock extends React.Component {
  constructor(props) {
    super(props);
    this.state = { now: new Date() };
  }

  componentDidMount() {
    this.timer = setInterval(() => this.setState({ now: new Date() }), 1000);
  }

  componentWillUnmount() {
    clearInterval(this.timer);
  }

  render() {
    return <span className="clock">{this.state.now.toLocaleTimeString()}</span>;
  }
}
""",
    ),
    (
        "This counter is shared by the threads of a web server and it loses hits. Make it thread-safe.",
        "python",
        r"""
class HitCounter:
    def __init__(self):
        self.counts = {}

    def hit(self, key):
        current = self.counts.get(key, 0)
        self.counts[key] = current + 1

    def top(self, n):
        return sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)[:n]
""",
    ),
    (
        "Convert this MySQL table definition to PostgreSQL.",
        "sql",
        r"""
CREATE TABLE sessions (
  id INT UNSIGNED NOT NULL AUTO_INCREMENT,
  user_id INT UNSIGNED NOT NULL,
  token VARCHAR(64) NOT NULL,
  created_at DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
  expires_at DATETIME NOT NULL,
  PRIMARY KEY (id),
  UNIQUE KEY uniq_token (token),
  KEY idx_user (user_id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
""",
    ),
    (
        "Make this more idiomatic: take a slice, avoid the index loop, and fix whatever clippy would complain "
        "about.",
        "rust",
        r"""
fn longest_run(v: &Vec<i32>) -> usize {
    if v.len() == 0 {
        return 0;
    }
    let mut max_len = 1;
    let mut cur = 1;
    for i in 1..v.len() {
        if v[i] == v[i - 1] {
            cur = cur + 1;
            if cur > max_len {
                max_len = cur;
            }
        } else {
            cur = 1;
        }
    }
    return max_len;
}
""",
    ),
    (
        "Every conversion calls the API. Cache the rates per base currency in memory and refresh them after 10 "
        "minutes.",
        "python",
        r"""
import requests


def get_exchange_rate(base, target):
    url = f"https://api.example.com/rates?base={base}"
    data = requests.get(url, timeout=10).json()
    return data["rates"][target]


def convert(amount, base, target):
    return round(amount * get_exchange_rate(base, target), 2)
""",
    ),
    (
        "Make Version objects comparable (==, <, sorting), give them a useful __repr__, and accept a leading "
        '"v" as in "v1.2.3".',
        "python",
        r"""
class Version:
    def __init__(self, text):
        major, minor, patch = text.split(".")
        self.major = int(major)
        self.minor = int(minor)
        self.patch = int(patch)

    def bump(self, part):
        if part == "major":
            return Version(f"{self.major + 1}.0.0")
        if part == "minor":
            return Version(f"{self.major}.{self.minor + 1}.0")
        return Version(f"{self.major}.{self.minor}.{self.patch + 1}")
""",
    ),
    (
        'This logs "undefined: NaN" every second. Fix it.',
        "javascript",
        r"""
class Timer {
  constructor(label) {
    this.label = label;
    this.ticks = 0;
  }

  start() {
    this.handle = setInterval(function () {
      this.ticks += 1;
      console.log(`${this.label}: ${this.ticks}`);
    }, 1000);
  }

  stop() {
    clearInterval(this.handle);
  }
}
""",
    ),
    (
        "Add JSON tags (snake_case, referral optional), reject unknown fields, validate the email, a password "
        "of at least 10 characters and age >= 13, and answer 400 with a JSON error when the input is invalid.",
        "go",
        r"""
type Signup struct {
    Email    string
    Password string
    Age      int
    Referral string
}

func handleSignup(w http.ResponseWriter, r *http.Request) {
    var s Signup
    json.NewDecoder(r.Body).Decode(&s)
    saveSignup(s)
    w.WriteHeader(http.StatusCreated)
}
""",
    ),
    (
        "Replace this bubble sort with a call to qsort, with a comparison function that cannot overflow.",
        "c",
        r"""
void sort_ints(int *a, int n) {
    for (int i = 0; i < n - 1; i++) {
        for (int j = 0; j < n - 1 - i; j++) {
            if (a[j] > a[j + 1]) {
                int t = a[j];
                a[j] = a[j + 1];
                a[j + 1] = t;
            }
        }
    }
}
""",
    ),
    (
        "Get rid of the globals: keep the state in a GameState class and make these functions its methods.",
        "python",
        r"""
score = 0
lives = 3
level = 1


def hit_enemy(points):
    global score, level
    score += points
    if score >= level * 1000:
        level += 1


def lose_life():
    global lives
    lives -= 1
    return lives > 0


def reset():
    global score, lives, level
    score, lives, level = 0, 3, 1
""",
    ),
    (
        'Add a `language` parameter with templates for "en", "fr" and "de", falling back to English for '
        "anything else.",
        "python",
        r"""
def send_welcome(user):
    subject = "Welcome!"
    body = f"Hi {user.first_name},\n\nThanks for joining us.\n"
    mailer.send(to=user.email, subject=subject, body=body)
""",
    ),
    (
        "Write vitest tests for this reducer.",
        "typescript",
        r"""
type State = { items: string[]; filter: "all" | "done" | "open"; done: Set<string> };
type Action =
  | { type: "add"; item: string }
  | { type: "toggle"; item: string }
  | { type: "filter"; value: State["filter"] };

export function reducer(state: State, action: Action): State {
  switch (action.type) {
    case "add":
      return state.items.includes(action.item) ? state : { ...state, items: [...state.items, action.item] };
    case "toggle": {
      const done = new Set(state.done);
      done.has(action.item) ? done.delete(action.item) : done.add(action.item);
      return { ...state, done };
    }
    case "filter":
      return { ...state, filter: action.value };
  }
}
""",
    ),
    (
        "The reader leaks when readLine throws. Fix that with try-with-resources and read the file as UTF-8 "
        "explicitly.",
        "java",
        r"""
public List<String> readNames(String path) throws IOException {
    BufferedReader reader = new BufferedReader(new FileReader(path));
    List<String> names = new ArrayList<>();
    String line;
    while ((line = reader.readLine()) != null) {
        if (!line.isBlank() && !line.startsWith("#")) {
            names.add(line.trim());
        }
    }
    reader.close();
    return names;
}
""",
    ),
    (
        "Make this fast for large inputs and escape the cell values so that the HTML is safe.",
        "python",
        r"""
def render_report(rows):
    html = "<table>"
    for row in rows:
        html += "<tr>"
        for cell in row:
            html += "<td>" + str(cell) + "</td>"
        html += "</tr>"
    html += "</table>"
    return html
""",
    ),
    (
        "Take the source and destination as arguments, print a usage message when they are missing, quote the "
        "variables, and add a --dry-run option that is passed on to rsync.",
        "bash",
        r"""
#!/bin/bash
SRC=/home/me/photos
DST=/mnt/backup/photos
rsync -a --delete $SRC/ $DST/
echo "done at $(date)"
""",
    ),
    (
        "The caller sometimes prints garbage. Explain what is wrong here and fix it.",
        "cpp",
        r"""
#include <string>
#include <vector>

const std::string& longest(const std::vector<std::string>& words) {
    std::string result;
    for (const auto& w : words) {
        if (w.size() > result.size()) {
            result = w;
        }
    }
    return result;
}
""",
    ),
    (
        "Make the transfer atomic, refuse it when the balance would go negative, and always close the "
        "connection.",
        "python",
        r"""
import sqlite3


def transfer(db_path, from_id, to_id, amount):
    conn = sqlite3.connect(db_path)
    cur = conn.cursor()
    cur.execute("UPDATE accounts SET balance = balance - ? WHERE id = ?", (amount, from_id))
    cur.execute("UPDATE accounts SET balance = balance + ? WHERE id = ?", (amount, to_id))
    conn.commit()
    conn.close()
""",
    ),
    (
        "Add docstrings with doctest examples to these three functions.",
        "python",
        r"""
def clamp(value, low, high):
    if low > high:
        raise ValueError("low must not exceed high")
    return max(low, min(value, high))


def lerp(a, b, t):
    return a + (b - a) * t


def remap(value, in_low, in_high, out_low, out_high):
    t = (value - in_low) / (in_high - in_low)
    return lerp(out_low, out_high, t)
""",
    ),
    (
        "Translate this JavaScript function to Python.",
        "javascript",
        r"""
function groupAnagrams(words) {
  const groups = new Map();
  for (const w of words) {
    const key = w.toLowerCase().split("").sort().join("");
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(w);
  }
  return [...groups.values()].filter((g) => g.length > 1);
}
""",
    ),
    (
        "Process the images concurrently, at most 4 at a time, with golang.org/x/sync/errgroup, stopping at "
        "the first error.",
        "go",
        r"""
func resizeAll(paths []string, width int) error {
    for _, p := range paths {
        img, err := loadImage(p)
        if err != nil {
            return err
        }
        out := resize(img, width)
        if err := saveImage(thumbPath(p), out); err != nil {
            return err
        }
    }
    return nil
}
""",
    ),
    (
        "Implement std::ops::Add and Display (formatted like $12.34, with a minus sign for negative amounts) "
        "instead of the add method, and write unit tests.",
        "rust",
        r"""
pub struct Money {
    cents: i64,
}

impl Money {
    pub fn new(cents: i64) -> Self {
        Money { cents }
    }

    pub fn add(&self, other: &Money) -> Money {
        Money::new(self.cents + other.cents)
    }
}
""",
    ),
    (
        "Fix this so it works with both timezone-aware and naive ISO strings (treat naive ones as UTC).",
        "python",
        r"""
from datetime import datetime


def is_expired(expires_at_iso):
    expires_at = datetime.fromisoformat(expires_at_iso)
    return datetime.now() > expires_at


# is_expired("2030-01-01T00:00:00+00:00") raises
# TypeError: can't compare offset-naive and offset-aware datetimes
""",
    ),
    (
        "Give these functions, their parameters and their local variables meaningful names, and add type hints.",
        "python",
        r"""
def proc(d, k, v=None):
    r = []
    for x in d:
        if k in x and (v is None or x[k] == v):
            r.append(x)
    return r


def proc2(d, k):
    o = {}
    for x in d:
        o.setdefault(x.get(k), []).append(x)
    return o
""",
    ),
    (
        "Make this safe when the customer, the address or any field is null (skip the missing lines), and use "
        "string interpolation.",
        "csharp",
        r"""
public static string FormatAddress(Customer customer)
{
    var a = customer.Address;
    return a.Street + "\n" + a.PostalCode + " " + a.City + "\n" + a.Country.ToUpper();
}
""",
    ),
    (
        "This only returns the first 30 repositories. Follow the pagination (the Link header) and turn it into a "
        "generator of names.",
        "python",
        r"""
import requests


def list_repos(org):
    r = requests.get(f"https://api.github.com/orgs/{org}/repos", timeout=10)
    r.raise_for_status()
    return [repo["name"] for repo in r.json()]
""",
    ),
    (
        "When userId changes, the card keeps showing the old user, and a slow response can overwrite a newer "
        "one. Fix both problems.",
        "tsx",
        r"""
function UserCard({ userId }: { userId: string }) {
  const [user, setUser] = useState<User | null>(null);

  useEffect(() => {
    fetch(`/api/users/${userId}`)
      .then((r) => r.json())
      .then((data) => setUser(data));
  }, []);

  if (!user) return <p>Loading...</p>;
  return <h2>{user.name}</h2>;
}
""",
    ),
    (
        "Make load a suspend function that runs on Dispatchers.IO, and get rid of the !! operator.",
        "kotlin",
        r"""
class ImageLoader(private val client: OkHttpClient) {
    fun load(url: String): ByteArray {
        val request = Request.Builder().url(url).build()
        client.newCall(request).execute().use { response ->
            if (!response.isSuccessful) throw IOException("HTTP ${response.code}")
            return response.body!!.bytes()
        }
    }
}
""",
    ),
    (
        "Write pytest tests for get_db_url with monkeypatch, covering every branch.",
        "python",
        r"""
import os


def get_db_url():
    url = os.environ.get("DATABASE_URL")
    if url:
        return url
    host = os.environ.get("DB_HOST", "localhost")
    port = int(os.environ.get("DB_PORT", "5432"))
    name = os.environ["DB_NAME"]
    return f"postgresql://{host}:{port}/{name}"
""",
    ),
    (
        "This should list the customers who never referred anyone, but it returns no rows at all. Explain why "
        "and rewrite it.",
        "sql",
        r"""
SELECT name
FROM customers
WHERE id NOT IN (SELECT referred_by FROM customers);
""",
    ),
    (
        "Add a --json flag that prints the same information as a JSON object, and collect the data in a "
        "function separate from the printing.",
        "python",
        r"""
import platform
import shutil
import sys


def main():
    total, used, free = shutil.disk_usage("/")
    print("python:", sys.version.split()[0])
    print("system:", platform.system(), platform.release())
    print("machine:", platform.machine())
    print(f"disk free: {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
""",
    ),
    (
        "Several threads call nextId and sometimes get the same id. Make the class thread-safe, preferably "
        "without synchronized.",
        "java",
        r"""
public class IdGenerator {
    private long next = 1;

    public long nextId() {
        return next++;
    }

    public void reset() {
        next = 1;
    }
}
""",
    ),
    (
        "This is slow with 5,000 items and open to HTML injection. Rewrite it with a DocumentFragment and "
        "textContent.",
        "javascript",
        r"""
function renderList(items) {
  const ul = document.getElementById("list");
  ul.innerHTML = "";
  items.forEach((item) => {
    ul.innerHTML += `<li class="item">${item.title} - ${item.author}</li>`;
  });
}
""",
    ),
    (
        "Convert these unittest tests to pytest style, with fixtures instead of setUp.",
        "python",
        r"""
import unittest

from shapes import Circle, Square


class ShapeTests(unittest.TestCase):
    def setUp(self):
        self.circle = Circle(2)
        self.square = Square(3)

    def test_circle_area(self):
        self.assertAlmostEqual(self.circle.area(), 12.566, places=3)

    def test_square_area(self):
        self.assertEqual(self.square.area(), 9)

    def test_negative_radius(self):
        with self.assertRaises(ValueError):
            Circle(-1)


if __name__ == "__main__":
    unittest.main()
""",
    ),
    (
        "Replace these two functions with one generic Max, and add a MaxBy that takes a key function.",
        "go",
        r"""
func MaxInt(xs []int) (int, bool) {
    if len(xs) == 0 {
        return 0, false
    }
    m := xs[0]
    for _, x := range xs[1:] {
        if x > m {
            m = x
        }
    }
    return m, true
}

func MaxFloat(xs []float64) (float64, bool) {
    if len(xs) == 0 {
        return 0, false
    }
    m := xs[0]
    for _, x := range xs[1:] {
        if x > m {
            m = x
        }
    }
    return m, true
}
""",
    ),
    (
        "Explain why this prints 40 40 40, and fix it.",
        "python",
        r"""
def make_multipliers():
    funcs = []
    for i in (2, 3, 4):
        funcs.append(lambda x: x * i)
    return funcs


double, triple, quadruple = make_multipliers()
print(double(10), triple(10), quadruple(10))  # expected 20 30 40
""",
    ),
    (
        "Make this function thread-safe and non-destructive (it must not modify line), and let the caller "
        "pass the delimiter characters.",
        "c",
        r"""
#include <string.h>

int count_fields(char *line) {
    int n = 0;
    char *tok = strtok(line, ",");
    while (tok != NULL) {
        n++;
        tok = strtok(NULL, ",");
    }
    return n;
}
""",
    ),
    (
        "Handle network failures, non-200 responses and bad JSON, printing a helpful message to stderr and "
        "exiting with a non-zero status.",
        "ruby",
        r"""
require "net/http"
require "json"

def fetch_stars(repo)
  uri = URI("https://api.github.com/repos/#{repo}")
  body = Net::HTTP.get(uri)
  JSON.parse(body)["stargazers_count"]
end

puts fetch_stars(ARGV[0])
""",
    ),
    (
        "The input files are several GB. Rewrite this to process the file in one streaming pass with constant "
        "memory, skipping blank lines.",
        "python",
        r"""
def read_numbers(path):
    with open(path) as f:
        lines = f.readlines()
    numbers = []
    for line in lines:
        numbers.append(float(line))
    return numbers


def stats(path):
    nums = read_numbers(path)
    return min(nums), max(nums), sum(nums) / len(nums)
""",
    ),
    (
        "Validate the body with zod (name of 1 to 100 characters, a valid email, a message of 10 to 5000 "
        "characters) and answer 400 with the validation errors.",
        "typescript",
        r"""
app.post("/api/contact", async (req, res) => {
  const { name, email, message } = req.body;
  await db.insert("messages", { name, email, message, createdAt: new Date() });
  res.status(201).json({ ok: true });
});
""",
    ),
    (
        "Make this class generic in the item type with typing.Generic and a TypeVar, fully annotated.",
        "python",
        r"""
class Repository:
    def __init__(self):
        self._items = {}
        self._next_id = 1

    def add(self, item):
        item_id = self._next_id
        self._items[item_id] = item
        self._next_id += 1
        return item_id

    def get(self, item_id):
        return self._items.get(item_id)

    def find(self, predicate):
        return [item for item in self._items.values() if predicate(item)]
""",
    ),
    (
        "Remove the unnecessary copies and the signed/unsigned comparisons, and also show a version using "
        "std::copy_if.",
        "cpp",
        r"""
std::vector<std::string> filterLong(std::vector<std::string> words, int minLen) {
    std::vector<std::string> out;
    for (int i = 0; i < words.size(); i++) {
        std::string w = words[i];
        if (w.length() >= minLen) {
            out.push_back(w);
        }
    }
    return out;
}
""",
    ),
    (
        "Write an async version of this for a client whose get_status is a coroutine, and measure the elapsed "
        "time with a monotonic clock instead of adding up the intervals.",
        "python",
        r"""
import time


def poll_job(client, job_id, interval=2.0, timeout=60.0):
    waited = 0.0
    while waited < timeout:
        status = client.get_status(job_id)
        if status in ("done", "failed"):
            return status
        time.sleep(interval)
        waited += interval
    raise TimeoutError(f"job {job_id} still running after {timeout}s")
""",
    ),
    (
        "This breaks on file names with spaces. Fix it so that it works for any file name.",
        "bash",
        r"""
#!/bin/bash
for file in $(ls ~/Downloads/*.pdf); do
  size=$(du -k $file | cut -f1)
  if [ $size -gt 10240 ]; then
    mv $file ~/Archive/
  fi
done
""",
    ),
    (
        "Write JUnit 5 tests for this class, with @ParameterizedTest where it fits.",
        "java",
        r"""
public final class PasswordPolicy {
    public static List<String> violations(String pw) {
        List<String> out = new ArrayList<>();
        if (pw == null || pw.length() < 12) out.add("at least 12 characters");
        if (pw != null && pw.chars().noneMatch(Character::isDigit)) out.add("a digit");
        if (pw != null && pw.chars().noneMatch(Character::isUpperCase)) out.add("an uppercase letter");
        if (pw != null && pw.chars().allMatch(Character::isLetterOrDigit)) out.add("a symbol");
        return out;
    }
}
""",
    ),
    (
        "The shares don't always add up to the total with the tip. Use Decimal and hand out the leftover cents "
        "so that the shares sum exactly.",
        "python",
        r"""
def split_bill(total, people, tip_percent=15):
    with_tip = total * (1 + tip_percent / 100)
    share = round(with_tip / people, 2)
    return [share] * people
""",
    ),
    (
        "Add structured logging with log/slog: file name, size and duration on success, and the error on each "
        "failure path.",
        "go",
        r"""
func (s *Server) handleUpload(w http.ResponseWriter, r *http.Request) {
    file, header, err := r.FormFile("file")
    if err != nil {
        http.Error(w, "bad upload", http.StatusBadRequest)
        return
    }
    defer file.Close()
    n, err := s.store.Save(header.Filename, file)
    if err != nil {
        http.Error(w, "could not save", http.StatusInternalServerError)
        return
    }
    fmt.Fprintf(w, "saved %d bytes\n", n)
}
""",
    ),
    (
        "Add a max_depth parameter and an option to hide dotfiles, and return the lines instead of printing "
        "them.",
        "python",
        r"""
from pathlib import Path


def list_tree(root, prefix=""):
    entries = sorted(Path(root).iterdir(), key=lambda p: (p.is_file(), p.name.lower()))
    for i, entry in enumerate(entries):
        last = i == len(entries) - 1
        print(prefix + ("└── " if last else "├── ") + entry.name)
        if entry.is_dir():
            list_tree(entry, prefix + ("    " if last else "│   "))
""",
    ),
    (
        "Port this Flask app to FastAPI, with Pydantic models for the request and the response.",
        "python",
        r"""
from flask import Flask, jsonify, request

app = Flask(__name__)
notes = []


@app.post("/notes")
def create_note():
    data = request.get_json()
    if not data or "text" not in data:
        return jsonify(error="text is required"), 400
    note = {"id": len(notes) + 1, "text": data["text"]}
    notes.append(note)
    return jsonify(note), 201


@app.get("/notes")
def list_notes():
    return jsonify(notes)
""",
    ),
    (
        "Rewrite this with LINQ, add a department parameter and give the method a more specific name.",
        "csharp",
        r"""
public List<string> GetNames(List<Employee> list)
{
    var r = new List<string>();
    foreach (var e in list)
    {
        if (e.Dept == "Sales" && e.Active)
        {
            r.Add(e.Last + ", " + e.First);
        }
    }
    r.Sort();
    return r;
}
""",
    ),
    (
        "Convert this CommonJS module to an ES module (remember that __dirname doesn't exist there).",
        "javascript",
        r"""
const path = require("path");
const { readFileSync } = require("fs");

const TEMPLATE_DIR = path.join(__dirname, "templates");

function render(name, vars) {
  const text = readFileSync(path.join(TEMPLATE_DIR, name + ".html"), "utf8");
  return text.replace(/\{\{(\w+)\}\}/g, (_, key) => (key in vars ? String(vars[key]) : ""));
}

module.exports = { render, TEMPLATE_DIR };
""",
    ),
    (
        "Write property-based tests with hypothesis for these two functions.",
        "python",
        r"""
def encode(data: bytes) -> str:
    return data.hex()


def decode(text: str) -> bytes:
    if len(text) % 2:
        raise ValueError("odd length")
    return bytes(int(text[i:i + 2], 16) for i in range(0, len(text), 2))
""",
    ),
    (
        "Rewrite this as an async function with tokio::fs that reads the metadata of all the paths "
        "concurrently.",
        "rust",
        r"""
use std::fs;
use std::path::Path;

fn total_size(paths: &[&str]) -> std::io::Result<u64> {
    let mut total = 0;
    for p in paths {
        let meta = fs::metadata(Path::new(p))?;
        total += meta.len();
    }
    Ok(total)
}
""",
    ),
    (
        "Fix the bug.",
        "python",
        r"""
def remove_inactive(users):
    for user in users:
        if not user["active"]:
            users.remove(user)
    return users


users = [{"name": "a", "active": False}, {"name": "b", "active": False}, {"name": "c", "active": True}]
print(remove_inactive(users))  # still contains "b"
""",
    ),
    (
        "Add an optional progress callback that receives the number of bytes read so far and the total size.",
        "python",
        r"""
import hashlib


def file_digest(path, algorithm="sha256", chunk_size=1 << 20):
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()
""",
    ),
    (
        "Add type signatures, make average safe for an empty list by returning Maybe, and explain the type "
        "class constraints you chose.",
        "haskell",
        r"""
average xs = sum xs / fromIntegral (length xs)

grade score
  | score >= 90 = 'A'
  | score >= 80 = 'B'
  | score >= 70 = 'C'
  | otherwise = 'F'

report scores = map (\s -> (s, grade s)) scores
""",
    ),
    (
        "Users who never logged in are missing from the result. Fix the query so that they are included, and "
        "turn it into a view named inactive_users.",
        "sql",
        r"""
SELECT u.id, u.email, MAX(l.logged_in_at) AS last_login
FROM users u
LEFT JOIN logins l ON l.user_id = u.id
GROUP BY u.id, u.email
HAVING MAX(l.logged_in_at) < NOW() - INTERVAL '90 days';
""",
    ),
    (
        "This takes forever. Make it fast, first with memoization and then as a bottom-up table.",
        "python",
        r"""
def count_ways(amount, coins):
    if amount == 0:
        return 1
    if amount < 0 or not coins:
        return 0
    return count_ways(amount - coins[0], coins) + count_ways(amount, coins[1:])


print(count_ways(500, [1, 2, 5, 10, 20, 50, 100, 200]))
""",
    ),
    (
        "Make this modal accessible: proper role and aria attributes, a real close button, Escape to close, and "
        "focus moved into the dialog and back to where it was.",
        "html",
        r"""
<div id="modal" class="modal hidden">
  <div class="modal-content">
    <span class="close" onclick="closeModal()">&times;</span>
    <p>Are you sure?</p>
    <button onclick="confirmAction()">Yes</button>
  </div>
</div>
<script>
  function openModal() {
    document.getElementById("modal").classList.remove("hidden");
  }
  function closeModal() {
    document.getElementById("modal").classList.add("hidden");
  }
</script>
""",
    ),
    (
        "This view runs hundreds of queries. Fix the N+1 problem and add pagination with a ?page= parameter, 20 "
        "articles per page.",
        "python",
        r"""
from django.http import JsonResponse

from .models import Article


def article_list(request):
    articles = Article.objects.all().order_by("-published")
    data = []
    for a in articles:
        data.append({
            "title": a.title,
            "author": a.author.name,
            "tags": [t.name for t in a.tags.all()],
        })
    return JsonResponse({"articles": data})
""",
    ),
    (
        "Use properties so that target stays between 5 and 30 degrees and mode is one of heat, cool or off; in "
        'mode "off" the status is always idle.',
        "python",
        r"""
class Thermostat:
    def __init__(self, target=20.0, mode="heat"):
        self.target = target
        self.mode = mode

    def adjust(self, delta):
        self.target += delta

    def status(self, current):
        if self.mode == "heat" and current < self.target:
            return "heating"
        if self.mode == "cool" and current > self.target:
            return "cooling"
        return "idle"
""",
    ),
    (
        "This crashes under load. Fix it, and add a constructor so that the map can never be nil.",
        "go",
        r"""
type Cache struct {
    items map[string]string
}

func (c *Cache) Get(key string) (string, bool) {
    v, ok := c.items[key]
    return v, ok
}

func (c *Cache) Set(key, value string) {
    c.items[key] = value
}

// used from many HTTP handlers at once:
// fatal error: concurrent map writes
""",
    ),
    (
        "The regex misses prices like $5 and $1,299.99, and its dot matches any character. Fix it and return "
        "Decimal values.",
        "python",
        r"""
import re


def extract_prices(text):
    return [float(m) for m in re.findall(r"\$(\d+.\d+)", text)]


print(extract_prices("Total: $1,299.99, shipping $5, tax $104.00"))
""",
    ),
    (
        "Rewrite with async/await, and let the caller see the error instead of swallowing it (still log it).",
        "typescript",
        r"""
function syncUser(id: string): Promise<void> {
  return api
    .getUser(id)
    .then((user) => db.upsertUser(user))
    .then(() => api.getOrders(id))
    .then((orders) => Promise.all(orders.map((o) => db.upsertOrder(o))))
    .then(() => log.info(`synced ${id}`))
    .catch((err) => log.error(err));
}
""",
    ),
    (
        "Use heapq.nlargest, add a keyword-only `lowest` flag that returns the lowest scores instead, and break "
        "ties by name.",
        "python",
        r"""
def top_n(scores, n):
    items = list(scores.items())
    items.sort(key=lambda kv: kv[1])
    items.reverse()
    return items[:n]
""",
    ),
    (
        "Change findByEmail to return Optional<Customer> and rewrite displayName without null checks.",
        "java",
        r"""
public Customer findByEmail(String email) {
    for (Customer c : customers) {
        if (c.getEmail().equalsIgnoreCase(email)) {
            return c;
        }
    }
    return null;
}

public String displayName(String email) {
    Customer c = findByEmail(email);
    if (c == null) {
        return "guest";
    }
    return c.getNickname() != null ? c.getNickname() : c.getFullName();
}
""",
    ),
    (
        "Write pytest-asyncio tests that check the results keep their order and that no more than `limit` "
        "coroutines run at the same time.",
        "python",
        r"""
import asyncio


async def gather_with_limit(coros, limit):
    semaphore = asyncio.Semaphore(limit)

    async def run(coro):
        async with semaphore:
            return await coro

    return await asyncio.gather(*(run(c) for c in coros))
""",
    ),
    (
        "Convert this C program to Rust.",
        "c",
        r"""
#include <stdio.h>

int gcd(int a, int b) {
    while (b != 0) {
        int t = b;
        b = a % b;
        a = t;
    }
    return a < 0 ? -a : a;
}

int main(void) {
    int pairs[][2] = {{12, 18}, {17, 5}, {-24, 36}, {0, 9}};
    for (int i = 0; i < 4; i++) {
        printf("gcd(%d, %d) = %d\n", pairs[i][0], pairs[i][1], gcd(pairs[i][0], pairs[i][1]));
    }
    return 0;
}
""",
    ),
    (
        "Skip files that are not images instead of crashing, create the output folder if needed, respect the "
        "EXIF orientation, and print how many files were converted and skipped.",
        "python",
        r"""
import os

from PIL import Image

for name in os.listdir("input"):
    img = Image.open(os.path.join("input", name))
    img.thumbnail((800, 800))
    img.save(os.path.join("output", name))
""",
    ),
    (
        "Rewrite this with Swift concurrency (async throws).",
        "swift",
        r"""
func fetchPosts(completion: @escaping (Result<[Post], Error>) -> Void) {
    let url = URL(string: "https://example.com/posts.json")!
    URLSession.shared.dataTask(with: url) { data, _, error in
        if let error = error {
            completion(.failure(error))
            return
        }
        do {
            let posts = try JSONDecoder().decode([Post].self, from: data ?? Data())
            completion(.success(posts))
        } catch {
            completion(.failure(error))
        }
    }.resume()
}
""",
    ),
    (
        "This is library code, yet it prints instead of raising. Make it raise specific exceptions (keeping the "
        "original cause), catch only the relevant errors, and leave the printing to the caller.",
        "python",
        r"""
import json


def load_users(path):
    try:
        with open(path) as f:
            users = json.load(f)
    except Exception:
        print("could not load users")
        return
    if not isinstance(users, list):
        print("bad format")
        return
    print(f"loaded {len(users)} users")
    return users
""",
    ),
    (
        "Write JUnit 5 tests in Kotlin for this object.",
        "kotlin",
        r"""
object Slug {
    private val nonAlnum = Regex("[^a-z0-9]+")

    fun of(title: String, maxLength: Int = 60): String {
        val base = title.lowercase()
            .replace(nonAlnum, "-")
            .trim('-')
        return if (base.length <= maxLength) base else base.take(maxLength).trimEnd('-')
    }
}
""",
    ),
    (
        "Turn this into a generator, and skip malformed lines instead of crashing, while still letting the "
        "caller find out how many were skipped.",
        "python",
        r"""
def parse_log(path):
    entries = []
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            ts, level, msg = line.rstrip("\n").split(" ", 2)
            entries.append({"ts": ts, "level": level, "msg": msg})
    return entries
""",
    ),
    (
        "Refactor this CSS with custom properties so that a new button color takes two lines, and add a "
        "visible focus style.",
        "css",
        r"""
.btn-primary {
  background: #2563eb;
  color: #fff;
  padding: 8px 16px;
  border-radius: 6px;
  border: 1px solid #1d4ed8;
}
.btn-primary:hover { background: #1d4ed8; }
.btn-danger {
  background: #dc2626;
  color: #fff;
  padding: 8px 16px;
  border-radius: 6px;
  border: 1px solid #b91c1c;
}
.btn-danger:hover { background: #b91c1c; }
""",
    ),
    (
        "Add type hints, with TypedDicts for the user, the items and the payload.",
        "python",
        r"""
def build_payload(user, items, coupon=None):
    payload = {
        "user_id": user["id"],
        "items": [{"sku": i["sku"], "qty": i["qty"]} for i in items],
        "currency": user.get("currency", "EUR"),
    }
    if coupon:
        payload["coupon"] = coupon.upper()
    return payload
""",
    ),
    (
        "Improve this Dockerfile: a smaller image, better layer caching, a non-root user and an exec-form CMD.",
        "dockerfile",
        r"""
FROM python:3.12
COPY . /app
WORKDIR /app
RUN pip install -r requirements.txt
CMD python app.py
""",
    ),
]
EDIT = [_fenced(text, lang, code, code_first=i % 4 == 2) for i, (text, lang, code) in enumerate(_EDIT)]

EXPLAIN = [
    _fenced("What does this print, and why?", "python", "grid = [[0] * 3] * 3\ngrid[0][0] = 1\nprint(grid)"),
    _fenced("Explain what this regular expression matches, piece by piece.", "text",
            r"^(?=.*\d)(?=.*[a-z])(?=.*[A-Z])(?=.*[^\w\s]).{12,64}$"),
    "What is the difference between a process and a thread? When would you choose one over the other?",
    _fenced(
        "Explain this traceback and how to fix it.", "text",
        'Traceback (most recent call last):\n  File "report.py", line 14, in <module>\n'
        "    total = total + row[2]\n"
        "TypeError: unsupported operand type(s) for +: 'int' and 'str'",
    ),
    _fenced(
        "Why is this query slow on a table with 10 million rows even though created_at and status are indexed?",
        "sql",
        "SELECT *\nFROM orders\nWHERE YEAR(created_at) = 2023\n  AND LOWER(status) = 'shipped';",
    ),
    "Explain what async and await do in JavaScript and how they relate to promises.",
    _fenced("What does this command do, and why -print0 and -0?", "bash",
            "find . -name '*.log' -mtime +30 -print0 | xargs -0 rm -f"),
    "What is the difference between == and is in Python? Why does `a is b` sometimes work for small integers?",
    _fenced(
        "What is the time complexity of this function, in the worst case and on average?", "python",
        "def first_repeat(items):\n    for i, x in enumerate(items):\n        for y in items[:i]:\n"
        "            if x == y:\n                return x\n    return None",
    ),
    _fenced(
        "I get `error[E0502]: cannot borrow `v` as mutable because it is also borrowed as immutable` on this "
        "code. What does it mean, and how should I write it instead?",
        "rust",
        "let mut v = vec![1, 2, 3];\nlet first = &v[0];\nv.push(4);\nprintln!(\"{}\", first);",
    ),
    "What is the difference between TCP and UDP, and when would you use each?",
    _fenced(
        "Explain what this Go code does.", "go",
        "select {\ncase msg := <-messages:\n    fmt.Println(\"received\", msg)\n"
        "case <-time.After(2 * time.Second):\n    fmt.Println(\"timed out\")\n"
        "case <-ctx.Done():\n    return ctx.Err()\n}",
    ),
    "What is a closure? Explain with a short JavaScript example.",
    "Walk me through what happens, step by step, when I type https://example.com in a browser and press Enter.",
    "Why does 0.1 + 0.2 == 0.3 evaluate to False in Python, and how should I compare floats?",
    _fenced(
        "What does this C program print? Explain the pointer arithmetic.", "c",
        "#include <stdio.h>\n\nint main(void) {\n    int a[] = {10, 20, 30, 40};\n    int *p = a;\n"
        "    printf(\"%d\\n\", *(p + 2));\n    printf(\"%d\\n\", *p++ + 1);\n    printf(\"%d\\n\", *p);\n"
        "    printf(\"%zu\\n\", sizeof(a) / sizeof(a[0]));\n    return 0;\n}",
    ),
    "Explain the difference between git merge and git rebase, and when a team would prefer each.",
    "Explain INNER JOIN, LEFT JOIN and FULL OUTER JOIN with two small example tables.",
    "What is Python's GIL, and how does it affect multithreaded programs? What are the workarounds?",
    _fenced(
        "What does this decorator do, and why is functools.wraps there?", "python",
        "import functools\nimport time\n\n\ndef timed(fn):\n    @functools.wraps(fn)\n"
        "    def wrapper(*args, **kwargs):\n        start = time.perf_counter()\n        try:\n"
        "            return fn(*args, **kwargs)\n        finally:\n"
        "            print(f\"{fn.__name__} took {time.perf_counter() - start:.3f}s\")\n    return wrapper",
    ),
    _fenced("Why do these lines print what they print?", "javascript",
            "console.log([1, 2, 10].sort());\nconsole.log(typeof null);\nconsole.log([] + {});\n"
            "console.log(\"5\" - 2, \"5\" + 2);"),
    _fenced(
        "Why is this slow for 50,000 emails, and how would you speed it up?", "python",
        "def unique_domains(emails):\n    seen = []\n    out = \"\"\n    for e in emails:\n"
        "        domain = e.split(\"@\")[1].lower()\n        if domain not in seen:\n"
        "            seen.append(domain)\n            out += domain + \"\\n\"\n    return out",
    ),
    "Explain the CAP theorem in simple terms, with an example of a system that picks each trade-off.",
    _fenced(
        "Explain what this Kubernetes manifest does.", "yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: api\nspec:\n  replicas: 3\n  selector:\n"
        "    matchLabels:\n      app: api\n  template:\n    metadata:\n      labels:\n        app: api\n"
        "    spec:\n      containers:\n        - name: api\n          image: registry.example.com/api:1.4.2\n"
        "          ports:\n            - containerPort: 8000\n          readinessProbe:\n"
        "            httpGet:\n              path: /healthz\n              port: 8000\n"
        "          resources:\n            limits:\n              memory: 512Mi",
    ),
    "What is dependency injection, and why is it useful? Show a small before-and-after example.",
    _fenced(
        "Why does this raise UnboundLocalError: local variable 'count' referenced before assignment?", "python",
        "count = 0\n\n\ndef increment():\n    count += 1\n    return count\n\n\nincrement()",
    ),
    "In Java, what is the difference between volatile and synchronized?",
    "Beyond mutability, what are the differences between a list and a tuple in Python?",
    "How does a hash map work internally? Cover hashing, collisions and resizing.",
    _fenced(
        "Explain what this query returns.", "sql",
        "SELECT department, name, salary,\n"
        "       salary - AVG(salary) OVER (PARTITION BY department) AS diff_from_dept,\n"
        "       RANK() OVER (ORDER BY salary DESC) AS overall_rank\nFROM employees;",
    ),
    _fenced(
        "Explain what each stage of this Dockerfile does and why it is split this way.", "dockerfile",
        "FROM golang:1.22 AS build\nWORKDIR /src\nCOPY go.mod go.sum ./\nRUN go mod download\nCOPY . .\n"
        "RUN CGO_ENABLED=0 go build -o /out/server ./cmd/server\n\n"
        "FROM gcr.io/distroless/static\nCOPY --from=build /out/server /server\nUSER nonroot\n"
        "ENTRYPOINT [\"/server\"]",
    ),
    "What is memoization, and how is it different from bottom-up dynamic programming?",
    "Explain the rule of five in C++. When can I follow the rule of zero instead?",
    _fenced(
        "Why does this print several groups for the same key?", "python",
        "from itertools import groupby\n\nwords = [\"apple\", \"bob\", \"avocado\", \"banana\", \"cherry\", "
        "\"apricot\"]\nfor letter, group in groupby(words, key=lambda w: w[0]):\n    print(letter, list(group))",
    ),
    "Explain *args and **kwargs in Python with examples, including how to forward them to another function.",
    "What is the difference between let, const and var in JavaScript?",
    "What is a race condition? Give a concrete example and show how to prevent it.",
    _fenced("What does this Haskell expression evaluate to, and why?", "haskell",
            "foldr (\\x acc -> x : take 2 acc) [] [1..10]"),
    _fenced(
        "My frontend gets this error in the browser console. What does it mean, and where is the fix: in the "
        "frontend or in the API?",
        "text",
        "Access to fetch at 'https://api.example.com/data' from origin 'http://localhost:5173' has been "
        "blocked by CORS policy: No 'Access-Control-Allow-Origin' header is present on the requested resource.",
    ),
    "How does HTTPS protect my data? Explain the TLS handshake at a high level.",
    "What are the differences between unit tests, integration tests and end-to-end tests?",
    "Explain what git bisect does and how to use it to find the commit that introduced a bug.",
    _fenced(
        "Explain the method resolution order here: what is printed, and why?", "python",
        "class A:\n    def hello(self):\n        return \"A\"\n\n\nclass B(A):\n    def hello(self):\n"
        "        return \"B\" + super().hello()\n\n\nclass C(A):\n    def hello(self):\n"
        "        return \"C\" + super().hello()\n\n\nclass D(B, C):\n    pass\n\n\n"
        "print(D().hello(), [k.__name__ for k in D.__mro__])",
    ),
    _fenced(
        "Why does this sometimes print garbage or crash?", "c",
        "char *make_label(int id) {\n    char label[32];\n    snprintf(label, sizeof label, \"item-%d\", id);\n"
        "    return label;\n}\n\nint main(void) {\n    char *a = make_label(1);\n    char *b = make_label(2);\n"
        "    printf(\"%s %s\\n\", a, b);\n}",
    ),
    "What is a JWT, what do its three parts contain, and what are the security pitfalls?",
    _fenced(
        "With Go 1.21 this prints 3 3 3 (in some order). Why? Does it change in Go 1.22?", "go",
        "for i := 0; i < 3; i++ {\n    go func() {\n        fmt.Println(i)\n    }()\n}\n"
        "time.Sleep(time.Second)",
    ),
    "What does the dependency array of React's useEffect do, and what happens when I leave it out?",
    _fenced("What does this sed command print?", "bash", "sed -n '/BEGIN/,/END/{/BEGIN/!{/END/!p}}' notes.txt"),
    "What is the difference between the stack and the heap in memory?",
    _fenced(
        "Explain how this descriptor works.", "python",
        "class Positive:\n    def __set_name__(self, owner, name):\n        self.name = \"_\" + name\n\n"
        "    def __get__(self, obj, objtype=None):\n        return getattr(obj, self.name)\n\n"
        "    def __set__(self, obj, value):\n        if value <= 0:\n"
        "            raise ValueError(f\"{self.name[1:]} must be positive\")\n"
        "        setattr(obj, self.name, value)\n\n\nclass Order:\n    quantity = Positive()\n"
        "    price = Positive()",
    ),
    _fenced("Explain the lifetime annotations in this Rust function.", "rust",
            "fn longest<'a>(x: &'a str, y: &'a str) -> &'a str {\n    if x.len() > y.len() { x } else { y }\n}"),
    "What does eventual consistency mean? Give an example a user might notice.",
    _fenced(
        "How do I read this stack trace, and what is the likely cause?", "text",
        "Exception in thread \"main\" java.lang.NullPointerException: Cannot invoke "
        "\"String.length()\" because \"<local2>\" is null\n"
        "\tat com.example.text.Stats.wordCount(Stats.java:27)\n"
        "\tat com.example.text.Report.build(Report.java:54)\n\tat com.example.App.main(App.java:12)",
    ),
    _fenced(
        "This total is much higher than it should be. Why?", "sql",
        "SELECT c.name, SUM(o.amount) AS revenue, COUNT(t.id) AS tickets\nFROM customers c\n"
        "JOIN orders o ON o.customer_id = c.id\nLEFT JOIN support_tickets t ON t.customer_id = c.id\n"
        "GROUP BY c.name;",
    ),
    "What is the difference between optimistic and pessimistic locking?",
    "How does garbage collection work in the JVM? Explain the generational idea.",
    _fenced("What does this TypeScript type do, and where would I use it?", "typescript",
            "type Mutable<T> = { -readonly [K in keyof T]: T[K] };"),
    "Explain the differences between Promise.all, Promise.allSettled, Promise.race and Promise.any.",
    "pip says requests is installed, but my script fails with ModuleNotFoundError: No module named 'requests'. "
    "What could be going on?",
    _fenced("What does the format spec in this f-string mean?", "python",
            "value = 3.14159\nname = \"pi\"\nprint(f\"{name!r:>8} = {value:+010.3f}\")"),
]

CHAT = [
    "How do I undo my last git commit but keep the changes in my working directory?",
    "My Docker container exits right after it starts. How can I find out why?",
    "What is a good way to structure a medium-sized FastAPI project?",
    "I'm a junior developer with a technical interview in three weeks. How should I prepare for the data "
    "structures and algorithms part?",
    "Write a short, polite email to my team lead asking to move our one-on-one from Tuesday to Thursday.",
    "Write a commit message for a change that fixes a race condition in our cache invalidation code.",
    "How do I find out which process is listening on port 8080 on Linux?",
    "PostgreSQL or MongoDB for a new online shop? Give me the pros and cons.",
    "What habits help in writing code that is still easy to maintain a year later?",
    "How do I set up SSH keys for GitHub on a new laptop?",
    "Explain in a few sentences what Kubernetes is, for a non-technical manager.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "How many bytes are there in a kibibyte, and how is that different from a kilobyte?",
    "I write Python scripts for data cleaning at work. What should I learn, in what order, to become a "
    "backend developer?",
    "How do I resolve a merge conflict in git, step by step?",
    "What is the difference between docker stop and docker kill?",
    "Write a short pull request description for a change that adds rate limiting to our public API.",
    "I get 'permission denied' when I run a script I just wrote on Linux. What should I check?",
    "REST or GraphQL for a new mobile app backend? When would you pick each?",
    "How can I make our development environment reproducible for new people joining the team?",
    "Give me five ideas for small side projects to practice Rust.",
    "How do I see how much disk space each folder in my home directory uses, from the terminal?",
    "Write a friendly Slack message announcing a 30-minute maintenance window on Saturday at 22:00 UTC.",
    "What is the best way to handle secrets like API keys in a web application?",
    "How do I squash my last three commits into one?",
    "How do I use tmux to keep a program running after I disconnect from SSH?",
    "My Python virtual environment broke after I upgraded Python. How do I recreate it cleanly?",
    "What does a good code review checklist include?",
    "How do I write a good bug report?",
    "Which is easier for a beginner to learn, Go or Rust? Why?",
    "How much faster is light than sound, roughly?",
    "Summarize the main ideas of the Agile Manifesto in a few bullet points.",
    "How do I write a cron entry that runs every weekday at 7:30?",
    "I get distracted by Slack and GitHub notifications all day. Any tips for staying focused as a developer?",
    "How do I copy a file from a running Docker container to my host?",
    "What is semantic versioning, and when should I bump the major version?",
    "Write a short cover letter paragraph for a backend developer job, highlighting Python and PostgreSQL "
    "experience.",
    "What should go in the .gitignore of a Node.js project?",
    "How do I check which version of a package is installed, with pip and with npm?",
    "In simple terms, what is the difference between a VPN and a proxy?",
    "How do I set an environment variable permanently on macOS?",
    "What is a good naming convention for git branches in a team?",
    "My team wants to move an existing JavaScript codebase to TypeScript. How do we do it incrementally?",
    "What is the difference between RAM and storage?",
    "How do I follow the logs of a systemd service in real time?",
    "What sections should the README of an open-source library have?",
    "A reviewer asked for changes I disagree with. How should I respond?",
    "What are common causes of memory leaks in long-running services?",
    "How would you set up monitoring and alerting for a small web service with a tiny team?",
    "How do I rename a git branch, locally and on the remote?",
    "Write a short message politely declining a meeting invitation because of a deadline.",
    "How do I turn a short video into a GIF with ffmpeg?",
    "What is the time complexity of the common operations on Python lists and dicts?",
    "Why do leap seconds exist, and why do some engineers want to get rid of them?",
    "Is it worth learning Vim today? What would I gain?",
    "How should a changelog describe a breaking change in a library?",
    "Microservices or a monolith for a five-person startup? What are the trade-offs?",
    "Give me a quick overview of the HTTP status code classes, with common examples of each.",
    "How do I make curl show the response headers and timing information?",
    "Write release notes for version 2.3.0 of a command-line tool: it adds a --json output flag, fixes a "
    "crash on empty input, and drops support for Python 3.8.",
]


def _interleave() -> list[dict]:
    """Blocks of 8 (4 code, 2 edit, 1 explain, 1 chat), the pattern rotated one step per block: every
    prefix of whole blocks is balanced, and the held-out prompts (every 20th) cover all kinds."""
    pattern = ("code", "edit", "code", "explain", "code", "edit", "code", "chat")
    pools = {"code": iter(CODE), "edit": iter(EDIT), "explain": iter(EXPLAIN), "chat": iter(CHAT)}
    out = []
    for block in range(len(CODE) // 4):
        for pos in range(len(pattern)):
            kind = pattern[(pos + block) % len(pattern)]
            out.append({"kind": kind, "prompt": next(pools[kind])})
    return out


PROMPTS: list[dict] = _interleave()
