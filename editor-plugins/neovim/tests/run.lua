--- Headless tests of specd.nvim against the real specd-lsp and real daemons.
---
---   nvim --headless -u NONE -i NONE -n -l tests/run.lua [pattern]
---
--- tests/test_editor_plugins.py runs this with SPECD_TEST_REAL_SOCKET (a daemon on a tiny random
--- model) and SPECD_TEST_FAKE_SOCKET (a model-free daemon whose completion of "…def main():\n    "
--- is always the same text, so edits can be checked exactly), with specd-lsp on PATH.
--- Every wait polls a condition with a deadline; nothing sleeps a fixed time.

local here = vim.fs.dirname(vim.fn.fnamemodify(debug.getinfo(1, 'S').source:sub(2), ':p'))
local plugin_dir = vim.fs.dirname(here)
local Child = dofile(here .. '/child.lua')

local REAL = os.getenv('SPECD_TEST_REAL_SOCKET')
local FAKE = os.getenv('SPECD_TEST_FAKE_SOCKET')
local STREAM = os.getenv('SPECD_TEST_STREAM_SOCKET') -- the stepped fake: a first line, then more
if not (REAL and FAKE) then
  io.stderr:write('run through pytest: tests/test_editor_plugins.py sets SPECD_TEST_REAL_SOCKET and SPECD_TEST_FAKE_SOCKET\n')
  os.exit(2)
end
local pattern = arg and arg[1]

local READY_MS = 60000 -- specd-lsp start and daemon connect (models are already loaded)
local SHOW_MS = 20000 -- request after typing pauses, plus a tiny model's forward passes on CPU
local EDIT_MS = 5000

local workdir = vim.fn.tempname()
vim.fn.mkdir(workdir, 'p')
local FILE = workdir .. '/fib.py'

local function assert_eq(actual, expected, what)
  if not vim.deep_equal(actual, expected) then
    error(('%s:\n  expected %s\n  got      %s'):format(what, vim.inspect(expected), vim.inspect(actual)), 2)
  end
end

local children = {}

--- A child Neovim with the plugin set up and fib.py open, its daemon ready.
---@param opts table setup() options; settings.daemon.socket is the daemon to use
local function session(opts)
  vim.fn.writefile(dofile(here .. '/probe.lua').SOURCE, FILE)
  local child = Child.new(plugin_dir, workdir)
  children[#children + 1] = child
  child:lua('_G.probe = dofile(...)', here .. '/probe.lua')
  child:lua('probe.open(...)', FILE, opts)
  child:wait('specd-lsp attached, daemon ready', READY_MS, 'return probe.ready()')
  return child
end

---@param socket string
---@param renderer string
---@param extra? table
local function options(socket, renderer, extra)
  return vim.tbl_deep_extend('force', {
    renderer = renderer,
    debounce_ms = 10,
    settings = { debounceMs = 0, maxTokens = 16, daemon = { socket = socket, spawn = false } },
  }, extra or {})
end

--- Puts the cursor at the end of line ROW in insert mode; waits for a suggestion to show.
---@return string ghost the ghost text shown
local function type_at_row(child)
  child:input('<Esc>')
  child:wait('normal mode', EDIT_MS, "return probe.mode() == 'n'")
  child:lua('probe.reset_buffer(); vim.api.nvim_win_set_cursor(0, { probe.ROW, 0 })')
  child:input('A')
  return child:wait('ghost text', SHOW_MS, 'return probe.ghost()')
end

local function line_at_row(child)
  return child:lua('return vim.api.nvim_buf_get_lines(0, probe.ROW - 1, probe.ROW, false)[1]')
end

local function wait_buffer_changed(child)
  return child:wait('the buffer to change', EDIT_MS, 'local b = probe.buffer(); return b ~= table.concat(probe.SOURCE, "\\n") and b')
end

local cases = {}
---@param opts? { native: boolean } native: needs the child's vim.lsp.inline_completion (0.12+)
local function case(name, fn, opts)
  cases[#cases + 1] = { name = name, fn = fn, native = opts and opts.native }
end

-- ---------------------------------------------------------------------------------------------

case('units: next line/word, status text, options', function()
  vim.opt.runtimepath:prepend(plugin_dir)
  local text, status, config = require('specd.text'), require('specd.status'), require('specd.config')
  assert_eq(text.next_line('foo(a)\n    bar'), 'foo(a)', 'next line')
  assert_eq(text.next_line('\n    bar\nbaz'), '\n    bar', 'next line after a break')
  assert_eq(text.next_word('  value = 1'), '  value', 'next word')
  assert_eq(text.next_word('(a, b)'), '(', 'punctuation run')
  assert_eq(text.next_word('  '), '  ', 'only blanks')

  assert_eq(status.format(nil, true), 'specd: starting', 'no status yet')
  assert_eq(status.format({ state = 'loading' }, true), 'specd: loading model', 'loading')
  assert_eq(status.format({ state = 'ready', enabled = true }, false), 'specd: off', 'off')
  assert_eq(status.format({ state = 'ready', lastLatencyMs = 41.6,
    acceptance = { lookup = { proposed = 30, accepted = 27 }, draft = { proposed = 70, accepted = 51 } } }, true),
    'specd 42ms 78%', 'ready')
  assert_eq(status.format({ state = 'unavailable', message = 'x' }, true), 'specd: unavailable', 'unavailable')
  local report = status.report({ state = 'ready', daemon = { pid = 7, version = '0.1.0', state = 'ready',
    models = { target = 't', draft = 'd' } }, shown = 3, accepted = 1 }, true)
  assert_eq(report, { 'specd: ready', 'suggestions: on', 'daemon: pid 7, specd 0.1.0, ready', 'model: t + draft d',
    'suggestions shown 3, accepted 1' }, 'report')

  local resolved = config.resolve({ cmd = { '/opt/specd-lsp' }, keymaps = { accept = '<C-l>' }, settings = { maxTokens = 32 } })
  assert_eq(resolved.cmd, { '/opt/specd-lsp' }, 'cmd replaced, not merged')
  assert_eq(resolved.keymaps.accept, '<C-l>', 'keymap override')
  assert_eq(resolved.keymaps.accept_line, '<M-l>', 'other keymaps kept')
  assert_eq(vim.json.encode(config.init_options({})), '{}', 'empty settings go out as an object')
  assert_eq(vim.json.decode(vim.json.encode(config.init_options(resolved.settings))), { maxTokens = 32 }, 'settings as given')
  assert_eq(resolved.debounce_ms, 0, 'the plugin renderer asks at each keystroke; specd-lsp debounces')
  assert_eq(config.init_options({ maxTokens = 32 }, false), { maxTokens = 32 }, 'asking at each keystroke: specd-lsp debounces')
  assert_eq(config.init_options({ maxTokens = 32 }, true), { maxTokens = 32, debounceMs = 0 },
    "Neovim's own typing pause (not taken over) is the debounce")
  assert_eq(config.init_options({ debounceMs = 50 }, true), { debounceMs = 50 }, 'a debounceMs set by the user stays')
  assert_eq(resolved.settings, { maxTokens = 32 }, 'the settings themselves untouched')
end)

case('setup registers specd-lsp, commands and keymaps; is idempotent; validates options', function()
  local child = session(options(FAKE, 'auto'))
  local support = child:lua("return require('specd.renderer').native_support()")
  local native = support == 'ok' or support == 'unknown'
  assert_eq(child:lua("return require('specd').renderer()"), native and 'native' or 'plugin', 'renderer')
  assert_eq(child:lua("return vim.lsp.get_clients({ name = 'specd' })[1].config.cmd"), { 'specd-lsp' }, 'server command')
  for _, command in ipairs({ 'Specd', 'SpecdStatus', 'SpecdToggle' }) do
    assert_eq(child:lua('return vim.fn.exists(":" .. ...)', command), 2, ':' .. command)
  end
  assert_eq(child:lua("return probe.imap('<Tab>')"), 'specd: accept', '<Tab> mapped')
  assert_eq(child:lua("return probe.imap('<M-l>')"), 'specd: accept line', '<M-l> mapped')
  if native then
    assert_eq(child:lua('return vim.lsp.inline_completion.is_enabled({ bufnr = 0 })'), true, 'inline completion on')
  end

  local autocmds = child:lua("return #vim.api.nvim_get_autocmds({ group = 'specd' })")
  child:lua("require('specd').setup(...)", options(FAKE, 'auto', { keymaps = { accept_word = '' } }))
  assert_eq(child:lua("return #vim.api.nvim_get_autocmds({ group = 'specd' })"), autocmds, 'autocmds after a second setup()')
  assert_eq(child:lua("return #vim.lsp.get_clients({ name = 'specd' })"), 1, 'one specd-lsp')
  assert_eq(child:lua("return probe.imap('<M-w>')"), vim.NIL, '"" unmaps accept_word')
  assert_eq(child:lua("return probe.imap('<Tab>')"), 'specd: accept', '<Tab> still mapped')

  for _, bad in ipairs({ { renderer = 'fancy' }, { keymaps = { accept = 1 } }, { keymaps = { accept_all = '<C-a>' } }, { cmd = {} } }) do
    local ok, err = unpack(child:lua("return { pcall(require('specd').setup, ...) }", bad))
    assert_eq(ok, false, 'setup(' .. vim.inspect(bad) .. ') fails')
    assert(tostring(err):find('renderer') or tostring(err):find('keymap') or tostring(err):find('cmd'), tostring(err))
  end
end)

case('native: the suggestion shown is the server\'s item; <Tab> inserts it; the accept reaches the server', function()
  local child = session(options(REAL, 'native'))
  local ghost = type_at_row(child)
  local answer = child:lua('return probe.server_item()')
  local item = answer.item
  assert(item, 'the server answered no item at the cursor')
  assert_eq({ item.range.start.line, item.range.start.character }, answer.cursor, 'the item starts at the cursor')
  assert_eq(ghost, item.insertText, 'ghost text is the item')

  child:input('<Tab>')
  local buffer = wait_buffer_changed(child)
  local expected = vim.deepcopy(dofile(here .. '/probe.lua').SOURCE)
  local lines = vim.split(item.insertText, '\n', { plain = true })
  local row = dofile(here .. '/probe.lua').ROW
  lines[1] = expected[row] .. lines[1]
  lines[#lines] = lines[#lines] .. expected[row]:sub(item.range['end'].character + 1)
  expected = vim.list_extend(vim.list_extend(vim.list_slice(expected, 1, row - 1), lines), vim.list_slice(expected, row + 1))
  assert_eq(buffer, table.concat(expected, '\n'), 'buffer after accept')
  assert_eq(child:lua('return probe.mode()'), 'i', 'still in insert mode')
  child:wait('specd/status counting the accept', EDIT_MS, "local s = require('specd').status(); return s and (s.accepted or 0) >= 1")
end, { native = true })

case('native: <M-l> accepts one line, <M-w> one word, <C-]> dismisses', function()
  local child = session(options(FAKE, 'native'))
  local ghost = type_at_row(child)
  local first, rest = ghost:match('^([^\n]*)\n(.*)$')
  assert(first and rest, 'the fake daemon\'s suggestion here spans lines: ' .. vim.inspect(ghost))

  child:input('<M-l>')
  child:wait('one line inserted', EDIT_MS, 'return vim.api.nvim_buf_get_lines(0, probe.ROW - 1, probe.ROW, false)[1] ~= "    "')
  assert_eq(line_at_row(child), '    ' .. first, 'the row holds the first line')
  assert_eq(child:lua('return vim.api.nvim_buf_line_count(0)'), #dofile(here .. '/probe.lua').SOURCE, 'no line added')
  assert_eq(child:lua('return probe.mode()'), 'i', 'still in insert mode')

  ghost = type_at_row(child)
  local word = ghost:match('^%s*[%w_]+') or ghost:match('^%s*[^%w_%s]+')
  child:input('<M-w>')
  child:wait('one word inserted', EDIT_MS, 'return vim.api.nvim_buf_get_lines(0, probe.ROW - 1, probe.ROW, false)[1] ~= "    "')
  assert_eq(line_at_row(child), '    ' .. word, 'the row holds the first word')
  child:wait('specd/status counting the partial accepts', EDIT_MS,
    "local s = require('specd').status(); return s and (s.acceptedPartial or 0) >= 2")

  type_at_row(child)
  child:input('<C-]>')
  child:wait('the ghost text to go', EDIT_MS, 'return probe.ghost() == nil')
  assert_eq(child:lua('return probe.buffer()'), table.concat(dofile(here .. '/probe.lua').SOURCE, '\n'), 'dismiss leaves the buffer')
end, { native = true })

case('native: asks at each keystroke; keeps an item typed through, fitted, and drops one typed away from', function()
  local child = session(options(FAKE, 'native', { debounce_ms = 0 }))
  local ghost = type_at_row(child)
  local first = ghost:sub(1, 1)
  assert(#ghost > 1 and first:match('%S'), 'the fake daemon\'s suggestion here: ' .. vim.inspect(ghost))
  local row = dofile(here .. '/probe.lua').ROW
  local source = dofile(here .. '/probe.lua').SOURCE

  -- Its first character and <Tab> at once (no cursor event between): the item, once.
  child:input(first .. '<Tab>')
  local expected = vim.deepcopy(source)
  local lines = vim.split(ghost, '\n', { plain = true })
  lines[1] = source[row] .. lines[1]
  expected = vim.list_extend(vim.list_extend(vim.list_slice(expected, 1, row - 1), lines), vim.list_slice(expected, row + 1))
  child:wait('the accept applied', EDIT_MS, 'return probe.buffer() == ...', table.concat(expected, '\n'))

  -- A character the item does not start with: the item goes at once and <Tab> is a <Tab>.
  assert_eq(type_at_row(child), ghost, 'the same suggestion again')
  child:input('Q<Tab>')
  local line = child:wait('the keys typed', EDIT_MS, 'local l = vim.api.nvim_buf_get_lines(0, probe.ROW - 1, probe.ROW, false)[1]; return l ~= "    " and l:find("Q") and l')
  assert(not line:find(vim.pesc(ghost:match('^[^\n]*')), 1, false), 'the dropped item was inserted: ' .. line)
  assert(vim.startswith(line, '    Q'), line)

  -- Asked at once after a keystroke, not after Neovim's 200 ms typing pause.
  child:lua('probe.record_requests(); probe.typed_at = vim.uv.hrtime()')
  child:input('x')
  local waited = child:wait('a request after the keystroke', EDIT_MS,
    'return probe.requested_at[1] and (probe.requested_at[1] - probe.typed_at) / 1e6')
  assert(waited < 150, ('asked %.0f ms after the key'):format(waited))
end, { native = true })

case('native: a late answer is drawn where it was typed through, never where its text is gone', function()
  local child = session(options(FAKE, 'native', { debounce_ms = 0 }))
  type_at_row(child)
  child:lua('probe.record_requests()')
  child:input('[')
  child:wait('a request after `[`', EDIT_MS, 'return #probe.requested_at >= 1')
  local asked = child:lua('return probe.requested_versions[1]')
  -- An answer to that request coming late, as one already on its way when the request was
  -- cancelled does (Neovim still calls the handler): what would it draw now?
  local late = [[
    local version = ...
    local bufnr = vim.api.nvim_get_current_buf()
    local state = require('vim.lsp._capability').all.inline_completion.active[bufnr]
    local client = vim.lsp.get_clients({ name = 'specd', bufnr = bufnr })[1]
    local at = { line = probe.ROW - 1, character = 5 } -- after `[`
    state:handler(nil, { items = { { insertText = 'main():', range = { start = at, ['end'] = at } } } },
      { client_id = client.id, bufnr = bufnr, version = version, method = 'textDocument/inlineCompletion' })
    local item = state.current
    return item and { item.insert_text, item.range.start.col, item.range.end_.col } or vim.NIL
  ]]
  child:input('m') -- typed through it: drawn, its span fitted over the `m`
  child:wait('the `m` typed', EDIT_MS, "return vim.api.nvim_get_current_line() == '    [m'")
  assert_eq(child:lua(late, asked), { 'main():', 5, 6 }, 'the late answer typed through')
  child:input('<BS><BS>') -- its text gone: the line no longer holds the `[` it was asked after
  child:wait('the line set back', EDIT_MS, "return vim.api.nvim_get_current_line() == '    '")
  local drawn = child:lua(late, asked)
  assert(drawn == vim.NIL or drawn[1] ~= 'main():', 'drawn where its text is gone: ' .. vim.inspect(drawn))
end, { native = true })

case('plugin renderer (0.10/0.11 path): shows, accepts, accepts a line, dismisses', function()
  local child = session(options(FAKE, 'plugin'))
  assert_eq(child:lua("return require('specd').renderer()"), 'plugin', 'renderer')
  assert_eq(child:lua('return vim.lsp.inline_completion == nil or vim.lsp.inline_completion.is_enabled({ bufnr = 0 })'),
    child:lua('return vim.lsp.inline_completion == nil'), 'native inline completion left off')
  local ghost = type_at_row(child)
  local answer = child:lua('return probe.server_item()')
  assert_eq(ghost, answer.item.insertText, 'ghost text is the item')

  child:input('<Tab>')
  local buffer = wait_buffer_changed(child)
  assert(buffer:find('\n    ' .. vim.pesc(ghost), 1, false), 'accepted text in the buffer:\n' .. buffer)

  ghost = type_at_row(child)
  child:input('<M-l>')
  child:wait('one line inserted', EDIT_MS, 'return vim.api.nvim_buf_get_lines(0, probe.ROW - 1, probe.ROW, false)[1] ~= "    "')
  assert_eq(line_at_row(child), '    ' .. ghost:match('^[^\n]*'), 'the row holds the first line')

  type_at_row(child)
  child:input('<C-]>')
  child:wait('the ghost text to go', EDIT_MS, 'return probe.ghost() == nil')
end)

-- What the streaming daemon writes (tests/fake_engine.py STREAMED_TEXT), a few characters a step.
local STREAMED = 'x = 1\n    y = 2\n    z = x + y\n    return z'

for _, renderer in ipairs({ 'plugin', 'native' }) do
  case(renderer .. ': the ghost text shows the first line, then grows to the whole suggestion', function()
    if not STREAM then
      error('SPECD_TEST_STREAM_SOCKET is not set (tests/test_editor_plugins.py sets it)')
    end
    local child = session(options(STREAM, renderer, { settings = { maxTokens = 64 } }))
    local first = type_at_row(child)
    assert(vim.startswith(STREAMED, first) and #first < #STREAMED, 'the first ghost text is a first part: ' .. first)
    child:wait('the ghost text to grow to the whole suggestion', SHOW_MS, 'return probe.ghost() == ...', STREAMED)
    local status = child:lua("return vim.lsp.get_clients({ name = 'specd' })[1]:request_sync('specd/status', {}, 5000, 0).result")
    assert_eq({ status.daemonRequests, status.streamed }, { 1, 1 }, 'one daemon complete, streamed')
    assert(status.grew >= 1 and status.cacheHits >= 1, vim.inspect(status))
  end, { native = renderer == 'native' })

  case(renderer .. ': a first line shown while it is written grows within its line, then to the rest', function()
    if not STREAM then
      error('SPECD_TEST_STREAM_SOCKET is not set (tests/test_editor_plugins.py sets it)')
    end
    -- A partial line as soon as there is one: the stepped fake's first step ('x =') is shown
    -- before its line settles a step later.
    local child = session(options(STREAM, renderer, { settings = { maxTokens = 64, partialLineMs = 1 } }))
    local first = type_at_row(child)
    assert_eq(first, 'x =', 'the first ghost text: the line being written, up to its last whole word part')
    child:wait('the ghost text to grow to its whole first line', SHOW_MS,
      'local g = probe.ghost(); return g ~= nil and vim.startswith(g, "x = 1")')
    child:wait('the ghost text to grow to the whole suggestion', SHOW_MS, 'return probe.ghost() == ...', STREAMED)
    local status = child:lua("return vim.lsp.get_clients({ name = 'specd' })[1]:request_sync('specd/status', {}, 5000, 0).result")
    assert_eq({ status.daemonRequests, status.streamed }, { 1, 1 }, 'one daemon complete, streamed')
    assert(status.grew >= 2, vim.inspect(status))
  end, { native = renderer == 'native' })
end

case('specd/didFocus: where the cursor came to rest, debounced, once per buffer and line', function()
  local child = session(options(FAKE, 'auto'))
  local uri = child:lua('return vim.uri_from_bufnr(0)')
  child:lua('probe.record_focus()')

  -- Two jumps within the debounce: one hint, where the cursor stopped.
  child:input('3G')
  child:input('5G')
  child:wait('a hint at the last jump', EDIT_MS, 'local f = probe.focused; return #f > 0 and f[#f][2] == 4')
  local hints = child:lua('return probe.focused')
  if #hints == 2 then -- the attach's own hint, if it was still pending when recording began
    assert_eq(hints[1], { uri, 0, 0 }, 'the hint of the buffer just attached')
  end
  assert_eq(hints[#hints], { uri, 4, 0 }, 'one hint, at the last jump')
  local count = #hints

  -- Along the same line, and into insert mode and out on it: the debounced send runs, sends nothing.
  for _, keys in ipairs({ '$', 'A', '<Esc>' }) do
    local runs = child:lua('return probe.focus_runs')
    child:input(keys)
    child:wait('the debounced send after ' .. keys, EDIT_MS, 'return probe.focus_runs > ...', runs)
  end
  assert_eq(#child:lua('return probe.focused'), count, 'no hint for the same line')

  -- Another line (ASCII: its character is the same in every position encoding).
  child:input('2G$')
  child:wait('a hint on line 2', EDIT_MS, 'return #probe.focused > ...', count)
  local last = #dofile(here .. '/probe.lua').SOURCE[2] - 1
  assert_eq(child:lua('return probe.focused[...]', count + 1), { uri, 1, last }, 'the hint at the end of line 2')

  -- Another buffer: its hint once specd attaches to it (its BufEnter came before the attach).
  local other = workdir .. '/other.py'
  vim.fn.writefile({ 'x = 1', 'y = 2' }, other)
  child:cmd('edit ' .. vim.fn.fnameescape(other))
  child:wait('a hint for other.py', READY_MS, 'return #probe.focused > ...', count + 1)
  assert_eq(vim.list_slice(child:lua('return probe.focused'), count), { { uri, 4, 0 }, { uri, 1, last },
    { vim.uri_from_fname(other), 0, 0 } }, 'the hints, in order')
end)

case('statusline, :SpecdToggle and :Specd', function()
  local child = session(options(REAL, 'auto'))
  local native = child:lua("return require('specd').renderer() == 'native'")
  type_at_row(child)
  child:input('<Esc>') -- leaving insert mode refreshes the status
  local line = child:wait('a latency in the statusline', EDIT_MS, "local s = require('specd').statusline(); return s:match('ms') and s")
  assert(line:match('^specd %d+ms'), line)
  child:cmd('SpecdToggle')
  assert_eq(child:lua("return require('specd').statusline()"), 'specd: off', 'statusline when off')
  assert_eq(child:lua("return require('specd').is_enabled()"), false, 'off')
  if native then
    assert_eq(child:lua('return vim.lsp.inline_completion.is_enabled({ bufnr = 0 })'), false, 'inline completion off')
  end
  child:cmd('Specd toggle')
  assert_eq(child:lua("return require('specd').is_enabled()"), true, 'on again')
  if native then
    assert_eq(child:lua('return vim.lsp.inline_completion.is_enabled({ bufnr = 0 })'), true, 'inline completion on again')
  end
  assert_eq(child:lua("return vim.fn.getcompletion('Specd ', 'cmdline')"),
    { 'disable', 'enable', 'health', 'log', 'restart', 'status', 'toggle' }, ':Specd completion')
  assert_eq(child:lua("return require('specd').statusline(vim.api.nvim_create_buf(false, true))"), '', 'statusline where specd is not attached')
end)

case('a second buffer closed leaves the client status to the buffer still using it', function()
  local child = session(options(REAL, 'auto'))
  local other = workdir .. '/other.py'
  vim.fn.writefile({ 'x = 1', '' }, other)
  child:cmd('edit ' .. vim.fn.fnameescape(other))
  child:wait('other.py attached to the same client', EDIT_MS,
    "return #vim.lsp.get_clients({ name = 'specd', bufnr = 0 }) == 1")
  child:cmd('bwipeout')
  child:wait('fib.py current again', EDIT_MS, "return vim.api.nvim_buf_get_name(0):match('fib%.py$') ~= nil")
  assert(child:lua('return probe.ready()'), 'the status of the client fib.py still uses was forgotten')
end)

case(':checkhealth specd passes (through the attached specd-lsp)', function()
  local child = session(options(REAL, 'auto'))
  local report = table.concat(child:lua('return probe.checkhealth()'), '\n')
  assert(not report:find('ERROR'), report)
  assert(not report:find('WARNING'), report)
  for _, expected in ipairs({ 'OK Neovim 0%.%d+%.%d+', 'OK specd%-lsp ', 'OK daemon pid %d+', 'via specd%-lsp', 'OK loaded: .*target %+ draft .*draft' }) do
    assert(report:find(expected), ('%q missing from:\n%s'):format(expected, report))
  end
end)

case(':checkhealth specd passes (straight to the daemon socket, nothing attached)', function()
  local child = Child.new(plugin_dir, workdir)
  children[#children + 1] = child
  child:lua("require('specd').setup(...)", options(REAL, 'auto'))
  local report = table.concat(child:lua("vim.cmd.checkhealth('specd'); return vim.api.nvim_buf_get_lines(0, 0, -1, false)"), '\n')
  assert(not report:find('ERROR'), report)
  assert(report:find('OK daemon pid %d+, specd .* %(via ' .. vim.pesc(REAL) .. '%)'), report)
  assert(report:find('OK loaded: '), report)
end)

case(':checkhealth specd reports an unreachable daemon promptly', function()
  local child = Child.new(plugin_dir, workdir)
  children[#children + 1] = child
  child:lua("require('specd').setup(...)", options(workdir .. '/nothing.sock', 'auto', { health_timeout_ms = 2000 }))
  local started = vim.uv.hrtime()
  local report = table.concat(child:lua("vim.cmd.checkhealth('specd'); return vim.api.nvim_buf_get_lines(0, 0, -1, false)"), '\n')
  assert(report:find('ERROR daemon not reachable'), report)
  assert((vim.uv.hrtime() - started) / 1e6 < 4000, 'health check took too long')
end)

--- Opens a second, longer Python file in the child (the first stays loaded and attached) with
--- the cursor at the end of line `row`, in insert mode, and types `keys` there.
local function second_buffer(child, row, keys)
  local lines = {}
  for i = 1, 300 do
    lines[i] = ('value_%d = %d'):format(i, i)
  end
  local big = workdir .. '/big.py'
  vim.fn.writefile(lines, big)
  child:lua('vim.cmd.edit(...)', big)
  child:wait('specd-lsp attached to both buffers', READY_MS,
    "local c = vim.lsp.get_clients({ name = 'specd' })[1]; return c and #vim.tbl_keys(c.attached_buffers) == 2")
  child:lua('probe.record_requests()')
  child:lua('vim.api.nvim_win_set_cursor(0, { ..., 0 })', row)
  child:input('A' .. keys)
  return vim.uri_from_fname(big)
end

local function errors_shown(child)
  return child:lua("return vim.fn.execute('messages') .. (vim.v.errmsg or '')")
end

for _, renderer in ipairs({ 'auto', 'native' }) do
  case(('%s renderer, two buffers: typing in one asks for that one only, and draws no errors'):format(renderer), function()
    local child = session(options(FAKE, renderer))
    local big_uri = second_buffer(child, 250, 'x')
    child:wait('ghost text in the second buffer', SHOW_MS, 'return probe.ghost()')
    child:input('yz')
    child:wait('ghost text after more typing', SHOW_MS, "return probe.ghost() and probe.ghost():find('xyz', 1, true)")
    local requested = child:lua('return probe.requested')
    assert_eq(vim.tbl_keys(requested), { big_uri }, 'the documents asked about')
    local messages = errors_shown(child)
    assert(not messages:find('out of bounds') and not messages:find('Error'), messages)
    if child:lua("return require('specd.renderer').native_support()") == 'all-buffers' then
      -- This build's own triggers fire in every buffer: 'auto' leaves them off, 'native' localizes them.
      assert_eq(child:lua("return require('specd').renderer()"), renderer == 'auto' and 'plugin' or 'native', 'renderer')
      local health = table.concat(child:lua('return probe.checkhealth()'), '\n')
      assert(health:find('every attached buffer on each keystroke', 1, true), health)
    end
    if child:lua("return require('specd').renderer()") == 'native' then
      local global = child:lua([[local n = 0
        for _, b in ipairs(vim.api.nvim_list_bufs()) do
          local ok, acs = pcall(vim.api.nvim_get_autocmds, { group = 'nvim.lsp.inline_completion:' .. b })
          for _, a in ipairs(ok and acs or {}) do n = n + (a.buflocal and 0 or 1) end
        end
        return n]])
      assert_eq(global, 0, 'inline completion autocommands that fire in every buffer')
    end
  end)
end

case('native: leaving insert mode within the typing pause sends no request behind the edits that follow', function()
  local child = session(options(FAKE, 'native'))
  -- "#slow" before the cursor makes the fake daemon hold an answer for 5 s (SPECD_TEST_SLOW_S).
  child:lua("vim.api.nvim_buf_set_lines(0, 0, 0, false, { '#slow' }); vim.api.nvim_win_set_cursor(0, { probe.ROW + 1, 0 })")
  -- A key, then <Esc> before vim.lsp.inline_completion's 200 ms pause ends: its timer would still
  -- ask (from normal mode), and draw the answer at a line the edit below removed ("Index out of bounds").
  child:input('Ax<Esc>')
  child:wait('normal mode', EDIT_MS, "return probe.mode() == 'n'")
  vim.wait(400)
  child:cmd('silent %delete')
  vim.wait(6000) -- the held answer arrives within 5 s
  local messages = errors_shown(child)
  assert(not messages:find('out of bounds') and not messages:find('Error'), messages)
end, { native = true })

case('native: <M-]> asks for alternatives when one suggestion came, then cycles them', function()
  local child = session(options(REAL, 'native', { settings = { alternatives = 3, temperature = 1.0 } }))
  type_at_row(child)
  assert_eq(child:lua('return probe.hint()'), vim.NIL, 'no index hint for a single suggestion')
  child:input('<M-]>')
  local hint = child:wait('an alternative shown with its index', SHOW_MS, 'return probe.hint()')
  assert(hint:match('^ %(2/%d%)$'), hint)
  child:input('<M-[>')
  child:wait('back to the first', EDIT_MS, "return probe.hint() and probe.hint():match('^ %(1/')")
end, { native = true })

case('ghost text stands apart from code without termguicolors (cterm grey italic)', function()
  local child = Child.new(plugin_dir, workdir)
  children[#children + 1] = child
  child:lua('vim.o.termguicolors = false')
  child:lua("require('specd').setup(...)", options(FAKE, 'auto'))
  local ghost = child:lua("return vim.api.nvim_get_hl(0, { name = 'SpecdGhost', link = false })")
  assert(ghost.ctermfg ~= nil, 'SpecdGhost has a cterm colour: ' .. vim.inspect(ghost))
  assert_eq(ghost.cterm and ghost.cterm.italic, true, 'SpecdGhost is italic in a terminal')
  local code = child:lua("return vim.api.nvim_get_hl(0, { name = 'Normal', link = false })")
  assert(ghost.ctermfg ~= code.ctermfg, 'ghost and code differ')
  local hint = child:lua("return vim.api.nvim_get_hl(0, { name = 'ComplHint', link = false })")
  assert(hint.ctermfg ~= nil or next(hint) == nil, "0.12's ComplHint has a cterm colour: " .. vim.inspect(hint))
  child:cmd('colorscheme default')
  ghost = child:lua("return vim.api.nvim_get_hl(0, { name = 'SpecdGhost', link = false })")
  assert(ghost.ctermfg ~= nil, 'SpecdGhost survives :colorscheme')
end)

-- ---------------------------------------------------------------------------------------------

local probe_child = Child.new(plugin_dir, workdir)
local child_has_native = probe_child:lua('return vim.lsp.inline_completion ~= nil')
probe_child:stop()
local function say(line)
  io.stdout:write(line, '\n')
end

local failed, ran = 0, 0
for index, c in ipairs(cases) do
  if c.native and not child_has_native then
    say(('ok %d - %s # SKIP needs vim.lsp.inline_completion'):format(index, c.name))
  elseif not pattern or c.name:find(pattern, 1, true) then
    ran = ran + 1
    local started = vim.uv.hrtime()
    local ok, err = xpcall(c.fn, debug.traceback)
    local seconds = (vim.uv.hrtime() - started) / 1e9
    for _, child in ipairs(children) do
      child:stop()
    end
    children = {}
    if ok then
      say(('ok %d - %s (%.1f s)'):format(index, c.name, seconds))
    else
      failed = failed + 1
      say(('not ok %d - %s (%.1f s)\n    %s'):format(index, c.name, seconds, (tostring(err):gsub('\n', '\n    '))))
    end
  end
end
vim.fn.delete(workdir, 'rf')
say(('# %d passed, %d failed'):format(ran - failed, failed))
os.exit(failed == 0 and ran > 0 and 0 or 1)
