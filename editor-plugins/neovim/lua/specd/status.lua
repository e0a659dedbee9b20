--- specd-lsp's `specd/status` (request and notification): kept per client, shown in the
--- statusline and by :SpecdStatus.

local util = require('specd.util')

local M = {}

M.METHOD = 'specd/status'

---@class specd.Status
---@field state? string connecting|spawning|loading|ready|unavailable|stopped
---@field message? string
---@field enabled? boolean
---@field daemon? table
---@field shown? integer
---@field accepted? integer
---@field acceptedPartial? integer words or lines of a suggestion taken
---@field lastLatencyMs? number
---@field acceptance? table<string, {proposed: integer, accepted: integer}>

---@type table<integer, specd.Status>
local latest = {}

local BUSY = { connecting = 'connecting', spawning = 'starting daemon', loading = 'loading model' }

--- Handler for the notification (vim.lsp handler signature).
function M.on_notification(_, result, ctx)
  if type(result) ~= 'table' then
    return
  end
  latest[ctx.client_id] = result
  vim.schedule(function()
    vim.cmd.redrawstatus({ bang = true })
    vim.api.nvim_exec_autocmds('User', { pattern = 'SpecdStatus', modeline = false, data = result })
  end)
end

---@param client_id integer
---@return specd.Status?
function M.get(client_id)
  return latest[client_id]
end

---@param client_id integer
function M.forget(client_id)
  latest[client_id] = nil
end

--- Accepted over proposed draft tokens, over all drafting sources; nil before any.
---@param acceptance? table<string, {proposed: integer, accepted: integer}>
---@return number?
function M.draft_acceptance(acceptance)
  local proposed, accepted = 0, 0
  for _, counts in pairs(type(acceptance) == 'table' and acceptance or {}) do
    proposed = proposed + (tonumber(counts.proposed) or 0)
    accepted = accepted + (tonumber(counts.accepted) or 0)
  end
  return proposed > 0 and accepted / proposed or nil
end

local function number(value)
  return type(value) == 'number' and value or nil
end

--- The statusline text: "specd 42ms 78%" when ready, "specd: <state>" otherwise.
---@param status? specd.Status
---@param enabled boolean
---@return string
function M.format(status, enabled)
  if not enabled or (status and status.enabled == false) then
    return 'specd: off'
  end
  if not status then
    return 'specd: starting'
  end
  local state = status.state or 'connecting'
  if BUSY[state] then
    return 'specd: ' .. BUSY[state]
  end
  if state ~= 'ready' then
    return 'specd: ' .. state
  end
  local parts = { 'specd' }
  local latency = number(status.lastLatencyMs)
  if latency then
    parts[#parts + 1] = ('%dms'):format(math.floor(latency + 0.5))
  end
  local rate = M.draft_acceptance(status.acceptance)
    or M.draft_acceptance(type(status.daemon) == 'table' and status.daemon.acceptance or nil)
  if rate then
    parts[#parts + 1] = ('%d%%'):format(math.floor(rate * 100 + 0.5))
  end
  return table.concat(parts, ' ')
end

--- :SpecdStatus's lines.
---@param status specd.Status
---@param enabled boolean
---@return string[]
function M.report(status, enabled)
  local daemon = type(status.daemon) == 'table' and status.daemon or {}
  local models = type(daemon.models) == 'table' and daemon.models or {}
  local lines = {
    ('specd: %s%s'):format(status.state or '?', status.message and status.message ~= '' and (' (' .. status.message .. ')') or ''),
    ('suggestions: %s'):format(enabled and 'on' or 'off'),
  }
  if number(daemon.pid) then
    lines[#lines + 1] = ('daemon: pid %d, specd %s, %s'):format(daemon.pid, daemon.version or '?', daemon.state or '?')
  end
  if type(models.target) == 'string' then
    lines[#lines + 1] = ('model: %s%s'):format(models.target, type(models.draft) == 'string' and (' + draft ' .. models.draft) or '')
  end
  if number(status.lastLatencyMs) then
    lines[#lines + 1] = ('last latency: %.0f ms'):format(status.lastLatencyMs)
  end
  if number(status.shown) then
    local partial = number(status.acceptedPartial) or 0
    lines[#lines + 1] = ('suggestions shown %d, accepted %d%s'):format(status.shown, number(status.accepted) or 0,
      partial > 0 and (' (and %d partly)'):format(partial) or '')
  end
  local rate = M.draft_acceptance(status.acceptance)
  if rate then
    lines[#lines + 1] = ('draft tokens accepted: %.0f%%'):format(rate * 100)
  end
  return lines
end

--- Asks a client for a fresh status, waiting at most `timeout_ms`.
---@param client vim.lsp.Client
---@param timeout_ms integer
---@return specd.Status? status, string? err
function M.fetch(client, timeout_ms)
  local done, result, failure = false, nil, nil
  local ok = util.request(client, M.METHOD, vim.empty_dict(), function(err, res)
    done, result, failure = true, res, err and (err.message or vim.inspect(err)) or nil
  end)
  if not ok then
    return nil, 'the language server is not running'
  end
  if not vim.wait(timeout_ms, function()
    return done
  end, 20) then
    return nil, ('no answer to %s within %d ms'):format(M.METHOD, timeout_ms)
  end
  if result then
    latest[client.id] = result
  end
  return result, failure
end

return M
