<#
.SYNOPSIS
    For MoE Desk installed inside WSL (installers/linux/install.sh): a Windows Start-menu shortcut that starts
    the Linux app, whose window WSLg shows on the Windows desktop.

.DESCRIPTION
    The shortcut runs wslg.exe (no console window; it comes with WSL from the Microsoft Store) or, where that
    is missing, wsl.exe in a minimised window:  wslg.exe -d DISTRO -e /home/USER/.local/bin/moedesk
    install.sh --windows-shortcut runs this from inside WSL with -Distro and -LauncherPath filled in.
    Run alone, it asks the distribution for the launcher's path.

.EXAMPLE
    powershell -NoProfile -ExecutionPolicy Bypass -File wsl-shortcut.ps1 -Distro Ubuntu
.EXAMPLE
    powershell -NoProfile -ExecutionPolicy Bypass -File wsl-shortcut.ps1 -Remove
#>
[CmdletBinding()]
param(
    # the WSL distribution (default: the default one)
    [string]$Distro = '',
    # the launcher inside the distribution (default: ~/.local/bin/moedesk of its default user)
    [string]$LauncherPath = '',
    [switch]$Desktop,
    [switch]$Remove
)

$ErrorActionPreference = 'Stop'
Set-StrictMode -Version 3

$Name = 'MoE Desk (WSL)'
$IconDir = Join-Path $env:LOCALAPPDATA 'MoE Desk WSL'
$Links = @(
    (Join-Path ([Environment]::GetFolderPath('Programs')) "$Name.lnk"),
    (Join-Path ([Environment]::GetFolderPath('Desktop')) "$Name.lnk")
)

if ($Remove) {
    foreach ($path in $Links + @($IconDir)) {
        if (Test-Path -LiteralPath $path) { Remove-Item -LiteralPath $path -Recurse -Force; Write-Host "removed $path" }
    }
    exit 0
}

$wsl = Join-Path $env:SystemRoot 'System32\wsl.exe'
if (-not (Test-Path $wsl)) { throw 'wsl.exe not found: WSL is not installed' }
$distroArgs = @()
if ($Distro) { $distroArgs = @('-d', $Distro) }
if (-not $LauncherPath) {
    $home_ = & $wsl @distroArgs -e sh -c 'printf %s $HOME'  # no quotes inside: PowerShell 5.1 passes them badly
    if ($LASTEXITCODE -ne 0 -or -not $home_) { throw 'could not ask WSL for the home folder' }
    $LauncherPath = "$home_/.local/bin/moedesk"
}
& $wsl @distroArgs -e test -x $LauncherPath
if ($LASTEXITCODE -ne 0) { throw "$LauncherPath is not in WSL: run installers/linux/install.sh there first" }

# the icon must stay reachable when the distribution is not running: a copy on the Windows side
New-Item -ItemType Directory -Force -Path $IconDir | Out-Null
$icon = Join-Path $IconDir 'moedesk.ico'
$candidates = @((Join-Path $PSScriptRoot '..\..\resources\icons\moedesk.ico'), (Join-Path $PSScriptRoot 'moedesk.ico'))
$found = $candidates | Where-Object { Test-Path $_ } | Select-Object -First 1
if ($found) { Copy-Item -Force -Path $found -Destination $icon }

$wslg = @((Join-Path $env:ProgramFiles 'WSL\wslg.exe'), (Join-Path $env:SystemRoot 'System32\wslg.exe')) |
    Where-Object { Test-Path $_ } | Select-Object -First 1
$target = if ($wslg) { $wslg } else { $wsl }
$arguments = (@($distroArgs) + @('-e', $LauncherPath) | ForEach-Object { if ($_ -match '\s') { "`"$_`"" } else { $_ } }) -join ' '

$shell = New-Object -ComObject WScript.Shell
$paths = @($Links[0])
if ($Desktop) { $paths += $Links[1] }
foreach ($path in $paths) {
    $link = $shell.CreateShortcut($path)
    $link.TargetPath = $target
    $link.Arguments = $arguments
    $link.WorkingDirectory = $env:USERPROFILE
    if (Test-Path $icon) { $link.IconLocation = "$icon,0" }
    if (-not $wslg) { $link.WindowStyle = 7 }  # minimised: wsl.exe keeps a console window open
    $link.Description = 'MoE Desk, installed in WSL'
    $link.Save()
    Write-Host "made $path -> $target $arguments"
}
