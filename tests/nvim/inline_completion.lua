-- Headless Neovim (>= 0.12) as a real LSP client of specd-lsp.
--
-- Run as: nvim --headless --clean -c 'luafile tests/nvim/inline_completion.lua'
-- (not with -l: the script must return to Neovim's main loop for insert mode to start).
-- Inputs (environment): SPECD_TEST_NVIM_FILE (the Python file to open), SPECD_TEST_NVIM_LINE (1-based line
-- whose end the cursor goes to), SPECD_TEST_NVIM_SOCKET (the daemon's socket), SPECD_TEST_NVIM_PYTHON
-- (the interpreter that runs specd-lsp), SPECD_TEST_NVIM_LOG (specd-lsp's log file), SPECD_TEST_NVIM_OUT
-- (where the JSON result goes).
--
-- Steps: open the file, attach specd-lsp, wait for it to report the daemon ready, enter insert
-- mode at the end of the line (Neovim's inline completion then asks for a suggestion), read the
-- ghost text from the extmark Neovim draws, ask the daemon itself over its msgpack-rpc socket
-- (sockconnect + rpcrequest, as any Neovim plugin could) what it completes there, accept the
-- suggestion with vim.lsp.inline_completion.get(), and record the buffer.

local env = vim.env
local out = { steps = {} }
local function step(name) table.insert(out.steps, name) end

local function finish(err)
  out.error = err
  local file = assert(io.open(env.SPECD_TEST_NVIM_OUT, 'w'))
  file:write(vim.json.encode(out))
  file:close()
  vim.cmd('qall!')
end

local ok, err = pcall(function()
  assert(vim.lsp.inline_completion, 'this Neovim has no vim.lsp.inline_completion (needs 0.12)')
  out.nvim = tostring(vim.version())
  vim.cmd.edit(vim.fn.fnameescape(env.SPECD_TEST_NVIM_FILE))
  local buf = vim.api.nvim_get_current_buf()
  local line = tonumber(env.SPECD_TEST_NVIM_LINE)

  local status = {}
  local client_id = assert(vim.lsp.start({
    name = 'specd',
    cmd = { env.SPECD_TEST_NVIM_PYTHON, '-m', 'specd_lsp.server', '--log-level', 'debug', '--log-file', env.SPECD_TEST_NVIM_LOG },
    root_dir = vim.fs.dirname(env.SPECD_TEST_NVIM_FILE),
    init_options = {
      daemon = { socket = env.SPECD_TEST_NVIM_SOCKET, spawn = false, requestTimeoutMs = 120000 },
      debounceMs = 0,
      partialLineMs = 0, -- the first ghost text is a settled line, however slow the machine
      maxTokens = 16,
      timeBudgetMs = 120000,
    },
    handlers = {
      ['specd/status'] = function(_, result) status = result end,
    },
  }, { bufnr = buf }))
  local client = assert(vim.lsp.get_client_by_id(client_id))
  assert(vim.wait(60000, function() return status.state == 'ready' end, 50), 'specd-lsp never reported ready')
  out.offset_encoding = client.offset_encoding
  out.inline_provider = client.server_capabilities.inlineCompletionProvider ~= nil
  step('attached')

  vim.lsp.inline_completion.enable(true, { bufnr = buf })
  vim.api.nvim_win_set_cursor(0, { line, 0 })

  -- What the daemon itself completes at the end of that line, straight over its socket.
  local lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false)
  local chan = vim.fn.sockconnect('pipe', env.SPECD_TEST_NVIM_SOCKET, { rpc = true })
  local text = table.concat(lines, '\n') .. '\n'
  local cursor_byte = #table.concat(vim.list_slice(lines, 1, line), '\n')
  local answer = vim.rpcrequest(chan, 'complete', {
    uri = vim.uri_from_bufnr(buf), text = text, cursor = { byte_offset = cursor_byte },
    options = { max_tokens = 16, single_line = false, temperature = 0.0, time_budget_ms = 120000 },
  })
  vim.fn.chanclose(chan)
  out.daemon_text = answer.text
  out.daemon_offset = answer.offset
  step('asked the daemon')

  local ns = vim.api.nvim_create_namespace('nvim.lsp.inline_completion')
  local phase = 'ghost'
  local deadline = vim.uv.now() + 60000
  local timer = assert(vim.uv.new_timer())
  local function tick()
    if phase == 'ghost' then
      local marks = vim.api.nvim_buf_get_extmarks(buf, ns, 0, -1, { details = true })
      if #marks > 0 then
        local details = marks[1][4]
        local parts = {}
        for _, chunk in ipairs(details.virt_text or {}) do table.insert(parts, chunk[1]) end
        local ghost = table.concat(parts)
        for _, virt_line in ipairs(details.virt_lines or {}) do
          local pieces = {}
          for _, chunk in ipairs(virt_line) do table.insert(pieces, chunk[1]) end
          ghost = ghost .. '\n' .. table.concat(pieces)
        end
        out.ghost = ghost
        out.mode_at_ghost = vim.api.nvim_get_mode().mode
        step('ghost shown')
        out.get_returned = vim.lsp.inline_completion.get()
        phase = 'accept'
      end
    elseif phase == 'accept' then
      if status.accepted == 1 then  -- the item's command reached the server after the insert
        out.buffer = table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n')
        out.status_after_accept = status
        step('accepted')
        phase = 'done'
      end
    end
    if phase ~= 'done' and vim.uv.now() < deadline then
      return
    end
    timer:stop()
    timer:close()
    vim.cmd('stopinsert')
    out.buffer = out.buffer or table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n')
    local answer = client:request_sync('specd/status', {}, 10000, buf)
    out.server_status = answer and answer.result
    step('done')
    client:stop()
    vim.wait(5000, function() return client:is_stopped() end, 50)
    finish(phase ~= 'done' and ('timed out in phase ' .. phase) or nil)
  end
  -- Insert mode starts once this script returns to the main loop; the timer does the rest.
  timer:start(100, 50, vim.schedule_wrap(function()
    local ok_tick, tick_err = pcall(tick)
    if not ok_tick then
      pcall(timer.stop, timer)
      finish(tostring(tick_err))
    end
  end))
  vim.api.nvim_feedkeys('A', 'n', false)
end)
if not ok then
  finish(tostring(err))
end
